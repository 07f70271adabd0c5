"""Benchmarks: print numbers and write JSON (`edgefcl bench ...`, `make bench`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from edgefcl.bench.bare_step import bare_step_refs, print_refs
from edgefcl.bench.device_waits import device_waits, print_waits
from edgefcl.build import Setup, make_optimizer, prepare, use_cpu_threads
from edgefcl.config import ConfigError, RunConfig
from edgefcl.learn.export import export_onnx
from edgefcl.learn.learner import resolve_device
from edgefcl.learn.methods import get_method
from edgefcl.learn.models import build_model
from edgefcl.learn.scoring.perturb import IMAGE_VIEWS, make_perturber, tta_logits, tta_logits_looped
from edgefcl.learn.scoring.scores import uncertainty
from edgefcl.ondevice import OnnxModel
from edgefcl.outcomes.metrics import pm, sample_std
from edgefcl.sim.runs import simulate


def _time(fn, repeats: int) -> float:
    """Best-of-`repeats` wall time of fn() in seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def scoring_speed(model: torch.nn.Module, x: torch.Tensor, kind: str, repeats: int,
                  chunk: int) -> dict:
    """Batched TTA scoring (all P x N views in chunked passes of `chunk` samples, and in one
    single pass) vs one forward pass per view."""
    pert = make_perturber(kind, 0, 0.1, seed=0)
    views = pert(x)
    total = views.shape[0] * views.shape[1]
    batched = _time(lambda: tta_logits(model, x, pert, chunk=chunk), repeats)
    single = _time(lambda: tta_logits(model, x, pert, chunk=total), repeats)
    looped = _time(lambda: tta_logits_looped(model, x, pert), repeats)
    perturb = _time(lambda: pert(x), repeats)
    return {"candidates": int(x.shape[0]), "views": int(views.shape[0]), "chunk": chunk,
            "perturb_s": perturb, "batched_s": batched, "single_pass_s": single,
            "per_view_s": looped, "speedup": looped / batched}


def inference_speed(model: torch.nn.Module, sample_shape: tuple[int, ...], threads: int,
                    repeats: int, batch: int = 256) -> dict:
    """CPU inference of `model` in eval mode, torch vs onnxruntime (its ONNX export): latency
    of one sample, throughput at `batch` samples, export time and the largest logit gap."""
    model = copy.deepcopy(model).cpu().eval()
    t0 = time.perf_counter()
    onnx_model = OnnxModel(export_onnx(model, sample_shape), threads)
    export_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    x1, xb = (torch.rand(n, *sample_shape, generator=gen) for n in (1, batch))
    n1, nb = x1.numpy(), xb.numpy()
    with torch.no_grad():
        t_lat = _time(lambda: model(x1), repeats)
        t_batch = _time(lambda: model(xb), repeats)
        diff = float(np.abs(model(xb).numpy() - onnx_model.logits(nb)).max())
    o_lat = _time(lambda: onnx_model.logits(n1), repeats)
    o_batch = _time(lambda: onnx_model.logits(nb), repeats)
    return {"batch": batch, "export_s": export_s, "torch_latency_s": t_lat,
            "ort_latency_s": o_lat, "torch_per_s": batch / t_batch, "ort_per_s": batch / o_batch,
            "speedup": t_batch / o_batch, "max_abs_diff": diff}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two score vectors (ties: average ranks; NaN when either
    is constant)."""
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: NaN, which the caller drops
        return float(spearmanr(a.numpy(), b.numpy()).statistic)


def _agreement(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Median Spearman correlation over score pairs and the share at >= 0.9 (NaN dropped)."""
    rho = torch.tensor([spearman(a, b) for a, b in pairs], dtype=torch.float64)
    rho = rho[~rho.isnan()]
    if not rho.numel():
        return {"median_rho": None, "share_ge_0.9": None, "calls": 0}
    return {"median_rho": float(rho.median()), "share_ge_0.9": float((rho >= 0.9).double().mean()),
            "calls": int(rho.numel())}


def view_stability(logits: list[torch.Tensor], score: str,
                   retest: list[torch.Tensor] | None = None) -> dict:
    """How much the memory's ranking depends on its views, from the (P, N, C) logits of every
    scoring call of a run (calls with N >= 3):

    - prefixes: per k < P, the ranking from the first k views against the one from all P
      (would fewer views, as adaptive view counts would use, rank alike?);
    - retest: from the calls of a run with 2P views, the ranking from views [0, P) against
      the one from [P, 2P) (the same score drawn twice: how reproducible the ranking is).
    Each as the median Spearman correlation over calls and the share of calls at >= 0.9."""
    calls = [z for z in logits if z.shape[1] >= 3]
    p = min((z.shape[0] for z in calls), default=0)
    full = [uncertainty(score, z) for z in calls]
    prefixes = [{"views": k, **_agreement([(uncertainty(score, z[:k]), f)
                                           for z, f in zip(calls, full, strict=True)])}
                for k in range(2, p)]
    twice = [z for z in retest or [] if z.shape[1] >= 3 and z.shape[0] == 2 * p]
    n = float(np.mean([z.shape[1] for z in calls])) if calls else 0.0
    return {"views": p, "calls": len(calls), "mean_candidates": n, "prefixes": prefixes,
            "retest": _agreement([(uncertainty(score, z[:p]), uncertainty(score, z[p:]))
                                  for z in twice]) if twice else None}


def log_scores(logs: list[torch.Tensor]):
    """A `simulate` observer that makes every client append its scoring logits to `logs`."""
    def attach(client) -> None:
        client.learner.score_log = logs
    return attach


def _retest_logs(cfg: RunConfig, logs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The scoring logits of a run of `cfg` with twice the views of `logs`' run, when the
    second half of its views draws the same views afresh (noise views; image views in whole
    cycles of the 12 augmentations); else none."""
    p = logs[0].shape[0] if logs else 0
    if not p or (p % len(IMAGE_VIEWS) and prepare(cfg, cfg.seed).dataset.kind == "image"):
        return []
    twice: list[torch.Tensor] = []
    simulate(dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, perturbations=2 * p)),
             seed=cfg.seed, observe=log_scores(twice))
    return twice


def _print_stability(name: str, s: dict) -> None:
    cells = "  ".join(f"{r['views']}: {r['median_rho']:.2f} ({100 * r['share_ge_0.9']:.0f} %)"
                      for r in s["prefixes"] if r["median_rho"] is not None)
    print(f"{name:<7} {s['views']} views, {s['calls']} calls of {s['mean_candidates']:.1f} "
          f"candidates: {cells}")
    t = s["retest"]
    if t is not None and t["median_rho"] is not None:
        print(f"{'':<7} the {s['views']}-view ranking drawn twice ({t['calls']} calls): median "
              f"rho {t['median_rho']:.2f} ({100 * t['share_ge_0.9']:.0f} % at >= 0.9)")


def _per_batch_ms(r) -> dict:
    """Per mini-batch ms: the client thread's parts, `step` (their sum without the
    prequential monitor) and `score_thread` (scoring done on the second thread)."""
    n = max(r.extra["batches"], 1)
    t = {k: 1000 * v / n for k, v in r.extra["timings"].items()}
    t["step"] = sum(t.get(k, 0.0) for k in ("train", "score", "score_wait", "memory"))
    t["score_thread"] = 1000 * r.extra.get("background_timings", {}).get("score", 0.0) / n
    return t


def bare_train_ms(cfg: RunConfig, setup: Setup, seconds: float = 3.0) -> float:
    """Bare torch time of one mini-batch's training, ms (mean over `seconds`, at least one
    mini-batch, after a warm-up): `local_epochs` steps of a copy of the run's initial model
    with its optimizer, on the run's device, on 2 x batch_size samples of the first task (the
    batch and a same-size replay draw, as in every task after the first), without the views of
    the later steps, the replay draws or any bookkeeping: a reference for the training step
    the client's timings measure."""
    use_cpu_threads(cfg.learn.threads)
    device = resolve_device(cfg.learn.device)
    model = copy.deepcopy(setup.initial).to(device).train()
    opt = make_optimizer(model, cfg.learn)
    task = setup.tasks[0][0]
    n = 2 * cfg.data.batch_size
    x = torch.from_numpy(task.x_train[:n]).to(device)
    y = torch.from_numpy(task.y_train[:n]).long().to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one_batch() -> None:
        for _ in range(cfg.learn.local_epochs):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    for _ in range(10):
        one_batch()
    sync()
    t0 = time.perf_counter()
    batches = 0
    while True:
        one_batch()
        batches += 1
        sync()
        now = time.perf_counter()
        if now - t0 >= seconds:
            return 1000 * (now - t0) / batches


def cost_vs_cbr(cfg: RunConfig, out: Path, configs: tuple[str, ...] = ("demo", "28x28")
                ) -> dict:
    """Wall time of the configured BI run against CBR on the same stream, on the run's
    configuration and on digits upscaled to 28x28 images, interleaved seed by seed (the order
    alternates) so that other load hits both alike; per-batch time split of each; the bare
    torch training step timed after each seed's runs (its median is the reference). One
    untimed run of each method on a seed past the timed ones comes first: the process's
    one-time costs (torch's optimizer stack imported by the first run, the scoring graph's
    export, the scoring worker's start) would otherwise land in whichever run is first, as
    the bare step's own warm-up keeps them out of it. `configs`: which of the two to run."""
    from edgefcl.bench.memory_study import dataset_spec

    specs = {"demo": lambda: cfg.data.dataset, "28x28": lambda: dataset_spec("digits28", out)}
    report: dict = {}
    print(f"\n{cfg.learn.method} (selection {cfg.learn.selection}, rescore {cfg.learn.rescore}, "
          f"overlap {cfg.learn.score_overlap}) vs cbr, per mini-batch ms and wall s, "
          f"mean over {cfg.seeds} seed(s) after one untimed run of each. step = train + "
          f"score + wait + memory on the client's thread; thread = scoring done while "
          f"training, on the scoring worker (process {cfg.learn.score_process}) or a "
          f"second thread:")
    print(f"{'config':<7} {'method':<6} {'step':>7} {'train':>7} {'score':>7} {'wait':>6} "
          f"{'memory':>7} {'thread':>7} {'wall s':>7}")
    for name in configs:
        spec = specs[name]()
        run_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=spec))
        runs: dict[str, list] = {"cbr": [], cfg.learn.method: []}
        logs: list[torch.Tensor] = []  # the scoring calls of the first seed's run
        setup = prepare(run_cfg, cfg.seed)
        bares: list[float] = []  # the bare step, timed beside every seed's runs
        for m in ("cbr", cfg.learn.method):  # warm-up, untimed
            simulate(run_cfg, method=m, seed=cfg.seed + cfg.seeds)
        for i, seed in enumerate(range(cfg.seed, cfg.seed + cfg.seeds)):
            order = ["cbr", cfg.learn.method][:: 1 if i % 2 == 0 else -1]
            for m in order:
                probe = log_scores(logs) if i == 0 and m == cfg.learn.method else None
                runs[m].append(simulate(run_cfg, method=m, seed=seed, observe=probe))
            bares.append(bare_train_ms(run_cfg, setup, seconds=1.5))
        rows = {}
        for m, rs in runs.items():
            ms = [_per_batch_ms(r) for r in rs]
            row = {k: float(np.mean([t.get(k, 0.0) for t in ms]))
                   for k in ("step", "train", "score", "score_wait", "memory", "score_thread")}
            row["wall_s"] = float(np.mean([r.wall_s for r in rs]))
            row["wall_each"] = [r.wall_s for r in rs]
            row["step_each"] = [t["step"] for t in ms]
            row["train_each"] = [t.get("train", 0.0) for t in ms]
            rows[m] = row
            print(f"{name:<7} {m:<6} {row['step']:7.2f} {row['train']:7.2f} {row['score']:7.2f} "
                  f"{row['score_wait']:6.2f} {row['memory']:7.2f} {row['score_thread']:7.2f} "
                  f"{row['wall_s']:7.2f}")
        bi, cbr = rows[cfg.learn.method], rows["cbr"]
        bare = float(np.median(bares))
        ratios = {"wall": bi["wall_s"] / cbr["wall_s"],
                  "step_vs_train": bi["step"] / cbr["train"],
                  "step_vs_cbr_step": bi["step"] / cbr["step"],
                  "step_vs_bare_torch": bi["step"] / bare,
                  "cbr_train_vs_bare_torch": cbr["train"] / bare}
        print(f"{name:<7} bare torch training of a mini-batch ({cfg.learn.local_epochs} steps on "
              f"{2 * cfg.data.batch_size} samples, no views or replay draws; median of "
              f"{len(bares)}, one after each seed's runs): {bare:.2f} ms; "
              f"cbr's train is {ratios['cbr_train_vs_bare_torch']:.2f}x that")
        report[name] = {"dataset": spec, "runs": rows, "ratios": ratios, "bare_train_ms": bare,
                        "bare_train_ms_each": bares,
                        "view_stability": view_stability(
                            logs, get_method(cfg.learn.method).score,
                            _retest_logs(dataclasses.replace(run_cfg, learn=dataclasses.replace(
                                run_cfg.learn, method=cfg.learn.method)), logs))}
        print(f"{name:<7} ratios: wall {ratios['wall']:.2f}x, per-batch step / cbr train step "
              f"{ratios['step_vs_train']:.2f}x, step / bare torch training "
              f"{ratios['step_vs_bare_torch']:.2f}x, step / cbr step "
              f"{ratios['step_vs_cbr_step']:.2f}x")
    print("\nview stability: each scoring call's ranking from its first k views against all "
          "views (the first seed's run); k: median Spearman rho over calls (share of calls at "
          ">= 0.9); then the ranking drawn twice (a run with twice the views, each half "
          "against the other):")
    for name, r in report.items():
        _print_stability(name, r["view_stability"])
    return report


def bench_client(cfg: RunConfig, out: Path, repeats: int) -> dict:
    """Per-mini-batch time split and A/F for cached vs full re-scoring; cost against CBR;
    scoring speed."""
    report: dict = {"config": dataclasses.asdict(cfg), "runs": {}, "scoring": {}}
    report["vs_cbr"] = cost_vs_cbr(cfg, out)
    print(f"client benchmark on {cfg.data.dataset}, {cfg.fed.clients} clients, "
          f"method {cfg.learn.method}, device {cfg.learn.device}")
    print(f"per mini-batch, mean over {cfg.seeds} seed(s):")
    print(f"{'rescore':<10} {'train ms':>9} {'score ms':>9} {'wait ms':>8} {'thread ms':>10} "
          f"{'memory ms':>10} {'scored/batch':>13} {'A %':>12} {'F %':>12} {'wall s':>7}")
    for rescore in ("on_change", "never", "always"):
        run_cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, rescore=rescore))
        runs = [simulate(run_cfg, seed=s) for s in range(cfg.seed, cfg.seed + cfg.seeds)]
        n = max(sum(r.extra["batches"] for r in runs), 1)
        ms = [_per_batch_ms(r) for r in runs]
        row = {k: float(np.mean([t.get(k, 0.0) for t in ms]))
               for k in ("train", "score", "score_wait", "score_thread", "memory")}
        acc, fgt = [r.accuracy for r in runs], [r.forgetting for r in runs]
        row.update(scored_per_batch=sum(r.extra["scored_samples"] for r in runs) / n,
                   accuracy=float(np.mean(acc)), accuracy_std=sample_std(acc),
                   forgetting=float(np.mean(fgt)), forgetting_std=sample_std(fgt),
                   wall_s=float(np.mean([r.wall_s for r in runs])))
        report["runs"][rescore] = row
        print(f"{rescore:<10} {row['train']:9.2f} {row['score']:9.2f} {row['score_wait']:8.2f} "
              f"{row['score_thread']:10.2f} {row['memory']:10.2f} "
              f"{row['scored_per_batch']:13.1f} {pm(row['accuracy'], row['accuracy_std']):>12}"
              f" {pm(row['forgetting'], row['forgetting_std']):>12} {row['wall_s']:7.1f}")
    methods = dict.fromkeys((cfg.learn.method, "cbr"))
    report["device_waits"] = [device_waits(cfg, m) for m in methods]
    print_waits(report["device_waits"])
    setup = prepare(cfg, cfg.seed)
    n = cfg.learn.memory_size + cfg.data.batch_size
    x = torch.from_numpy(setup.tasks[0][0].x_train[:n])
    cases = [(f"{cfg.data.dataset}/{setup.dataset.kind}", setup.initial, x, setup.dataset.kind)]
    torch.manual_seed(0)
    img = torch.rand(n, 3, 32, 32)
    cases.append(("resnet18/32x32x3", build_model("resnet18", (3, 32, 32), 10), img, "image"))
    chunk = cfg.learn.score_chunk or (4096 if cfg.learn.device.startswith("cuda") else 256)
    print(f"\n{'scoring (TTA)':<22} {'cands':>6} {'views':>6} {'batched ms':>11} "
          f"{'one pass ms':>12} {'per-view ms':>12} {'speedup':>8}   (batched: chunks of {chunk})")
    for name, model, xs, kind in cases:
        s = scoring_speed(model, xs, kind, repeats, chunk)
        report["scoring"][name] = s
        print(f"{name:<22} {s['candidates']:6d} {s['views']:6d} {1000 * s['batched_s']:11.1f} "
              f"{1000 * s['single_pass_s']:12.1f} {1000 * s['per_view_s']:12.1f} "
              f"{s['speedup']:7.2f}x")
    report["bare_step"] = bare_step_refs(cfg, setup)
    print_refs(report["bare_step"])
    threads = cfg.learn.threads
    use_cpu_threads(threads)
    models = [(cases[0][0], setup.initial, setup.dataset.sample_shape)]
    for name, shape in (("mlp", (40,)), ("cnn", (1, 28, 28)), ("resnet18", (3, 32, 32))):
        models.append((f"{name}/{'x'.join(map(str, shape))}", build_model(name, shape, 10), shape))
    report["inference"] = {}
    print(f"\n{'inference (CPU, ' + str(threads) + ' thr)':<22} {'export ms':>9} "
          f"{'torch 1 ms':>10} {'ort 1 ms':>9} {'torch /s':>9} {'ort /s':>9} {'speedup':>8}")
    for name, model, shape in models:
        s = inference_speed(model, tuple(shape), threads, repeats)
        report["inference"][name] = s
        print(f"{name:<22} {1000 * s['export_s']:9.0f} {1000 * s['torch_latency_s']:10.2f} "
              f"{1000 * s['ort_latency_s']:9.2f} {s['torch_per_s']:9.0f} {s['ort_per_s']:9.0f} "
              f"{s['speedup']:7.2f}x")
    return report


def run_bench(what: str, cfg: RunConfig, out: Path, repeats: int,
              study: dict | None = None, count: int = 0) -> int:
    """Run benchmark `what` (client, transport, crash, fuzz, flood, memory); JSON goes to
    out/bench_<what>.json."""
    out.mkdir(parents=True, exist_ok=True)
    if what == "memory":
        from edgefcl.bench.memory_study import (
            DEFAULT_DATASETS,
            DEFAULT_PER_CLASS,
            DEFAULT_RULES,
            bench_memory,
        )

        study = study or {}
        datasets = _csv(study.get("datasets")) or list(DEFAULT_DATASETS)
        try:
            sizes = [int(v) for v in _csv(study.get("per_class"))] or list(DEFAULT_PER_CLASS)
        except ValueError as e:
            raise ConfigError(f"--per-class takes whole numbers, e.g. 5,10,20: {e}") from None
        if min(sizes) < 0:
            raise ConfigError(f"--per-class takes sizes >= 0 (0: no memory), got {min(sizes)}")
        rules = _csv(study.get("rules")) or list(DEFAULT_RULES)
        bench_memory(cfg, out, datasets, sizes, rules, int(study.get("jobs", 1)))
        print(f"\nwritten {out / 'bench_memory.json'}")
        return 0
    if what in BOUNDARY_BENCHES:
        report = BOUNDARY_BENCHES[what](cfg, out, count)
    else:
        report = {"client": bench_client, "transport": _bench_transport}[what](cfg, out, repeats)
    report["torch"] = torch.__version__
    report["threads"] = torch.get_num_threads()
    path = out / f"bench_{what}.json"
    path.write_text(json.dumps(report, indent=1, default=_jsonable))
    print(f"\nwritten {path}")
    return 0


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _bench_transport(cfg: RunConfig, out: Path, repeats: int) -> dict:
    from edgefcl.bench.transport import bench_transport  # the broker packages: only here

    return bench_transport(cfg, out, repeats)


def _bench_crash(cfg: RunConfig, out: Path, count: int) -> dict:
    from edgefcl.bench.crash import bench_crash

    return bench_crash(cfg, out, count)


def _bench_fuzz(cfg: RunConfig, out: Path, count: int) -> dict:
    from edgefcl.bench.fuzz import bench_fuzz

    return bench_fuzz(cfg, out, count)


def _bench_flood(cfg: RunConfig, out: Path, count: int) -> dict:
    from edgefcl.bench.flood import bench_flood

    return bench_flood(cfg, out, count)


BOUNDARY_BENCHES = {"crash": _bench_crash, "fuzz": _bench_fuzz, "flood": _bench_flood}
"""Benchmarks of the trust boundary; `--count` is their size (kills, payloads)."""


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))
