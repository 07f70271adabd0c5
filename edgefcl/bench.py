"""Benchmarks: print numbers and write JSON (`edgefcl bench ...`, `make bench`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from edgefcl.config import RunConfig
from edgefcl.learn.export import export_onnx
from edgefcl.learn.models import build_model
from edgefcl.learn.perturb import make_perturber, tta_logits, tta_logits_looped
from edgefcl.ondevice import OnnxModel
from edgefcl.simulate import prepare, simulate


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


def bench_client(cfg: RunConfig, out: Path, repeats: int) -> dict:
    """Per-mini-batch time split and A/F for cached vs full re-scoring; scoring speed."""
    report: dict = {"config": dataclasses.asdict(cfg), "runs": {}, "scoring": {}}
    print(f"client benchmark on {cfg.data.dataset}, {cfg.fed.clients} clients, "
          f"method {cfg.learn.method}, device {cfg.learn.device}")
    print(f"per mini-batch, mean over {cfg.seeds} seed(s):")
    print(f"{'rescore':<10} {'train ms':>9} {'score ms':>9} {'memory ms':>10} "
          f"{'scored/batch':>13} {'A %':>12} {'F %':>12} {'wall s':>7}")
    for rescore in ("on_change", "always"):
        run_cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, rescore=rescore))
        runs = [simulate(run_cfg, seed=s) for s in range(cfg.seed, cfg.seed + cfg.seeds)]
        n = max(sum(r.extra["batches"] for r in runs), 1)
        row = {k: 1000 * sum(r.extra["timings"].get(k, 0.0) for r in runs) / n
               for k in ("train", "score", "memory")}
        acc, fgt = [r.accuracy for r in runs], [r.forgetting for r in runs]
        row.update(scored_per_batch=sum(r.extra["scored_samples"] for r in runs) / n,
                   accuracy=float(np.mean(acc)), accuracy_std=float(np.std(acc)),
                   forgetting=float(np.mean(fgt)), forgetting_std=float(np.std(fgt)),
                   wall_s=float(np.mean([r.wall_s for r in runs])))
        report["runs"][rescore] = row
        print(f"{rescore:<10} {row['train']:9.2f} {row['score']:9.2f} {row['memory']:10.2f} "
              f"{row['scored_per_batch']:13.1f} {row['accuracy']:5.1f} ± {row['accuracy_std']:4.1f}"
              f" {row['forgetting']:5.1f} ± {row['forgetting_std']:4.1f} {row['wall_s']:7.1f}")
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
    threads = cfg.learn.threads
    torch.set_num_threads(threads)
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


def run_bench(what: str, cfg: RunConfig, out: Path, repeats: int, count: int = 0) -> int:
    out.mkdir(parents=True, exist_ok=True)
    from edgefcl.bench_transport import bench_transport

    if what in BOUNDARY_BENCHES:
        report = BOUNDARY_BENCHES[what](cfg, out, count)
    else:
        report = {"client": bench_client, "transport": bench_transport}[what](cfg, out, repeats)
    report["torch"] = torch.__version__
    report["threads"] = torch.get_num_threads()
    path = out / f"bench_{what}.json"
    path.write_text(json.dumps(report, indent=1, default=_jsonable))
    print(f"\nwritten {path}")
    return 0


def _bench_crash(cfg: RunConfig, out: Path, count: int) -> dict:
    from edgefcl.bench_crash import bench_crash

    return bench_crash(cfg, out, count)


def _bench_fuzz(cfg: RunConfig, out: Path, count: int) -> dict:
    from edgefcl.bench_fuzz import bench_fuzz

    return bench_fuzz(cfg, out, count)


BOUNDARY_BENCHES = {"crash": _bench_crash, "fuzz": _bench_fuzz}
"""Benchmarks of the trust boundary; `--count` is their size (kills, payloads)."""


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))
