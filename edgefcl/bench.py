"""Benchmarks: print numbers and write JSON (`edgefcl bench ...`, `make bench`)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from edgefcl.config import RunConfig
from edgefcl.learn.models import build_model
from edgefcl.learn.perturb import make_perturber, tta_logits, tta_logits_looped
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


def scoring_speed(model: torch.nn.Module, x: torch.Tensor, kind: str, repeats: int) -> dict:
    """Batched TTA scoring (all views in one chunked pass) vs one forward pass per view."""
    pert = make_perturber(kind, 0, 0.1, seed=0)
    views = pert(x)
    batched = _time(lambda: tta_logits(model, x, pert), repeats)
    looped = _time(lambda: tta_logits_looped(model, x, pert), repeats)
    perturb = _time(lambda: pert(x), repeats)
    return {"candidates": int(x.shape[0]), "views": int(views.shape[0]),
            "perturb_s": perturb, "batched_s": batched, "per_view_s": looped,
            "speedup": looped / batched}


def bench_client(cfg: RunConfig, out: Path, repeats: int) -> dict:
    """Per-mini-batch time split and A/F for cached vs full re-scoring; scoring speed."""
    report: dict = {"config": dataclasses.asdict(cfg), "runs": {}, "scoring": {}}
    print(f"client benchmark on {cfg.data.dataset}, {cfg.fed.clients} clients, "
          f"method {cfg.learn.method}, device {cfg.learn.device}")
    print(f"{'rescore':<10} {'train ms':>9} {'score ms':>9} {'memory ms':>10} "
          f"{'scored/batch':>13} {'A %':>6} {'F %':>6} {'wall s':>7}")
    for rescore in ("on_change", "always"):
        run_cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, rescore=rescore))
        r = simulate(run_cfg)
        t = r.extra["timings"]
        n = max(r.extra["batches"], 1)
        row = {k: 1000 * t.get(k, 0.0) / n for k in ("train", "score", "memory")}
        row.update(scored_per_batch=r.extra["scored_samples"] / n, accuracy=r.accuracy,
                   forgetting=r.forgetting, wall_s=r.wall_s)
        report["runs"][rescore] = row
        print(f"{rescore:<10} {row['train']:9.2f} {row['score']:9.2f} {row['memory']:10.2f} "
              f"{row['scored_per_batch']:13.1f} {row['accuracy']:6.1f} "
              f"{row['forgetting']:6.1f} {row['wall_s']:7.1f}")
    setup = prepare(cfg, cfg.seed)
    n = cfg.learn.memory_size + cfg.data.batch_size
    x = torch.from_numpy(setup.tasks[0][0].x_train[:n])
    cases = [(f"{cfg.data.dataset}/{setup.dataset.kind}", setup.initial, x, setup.dataset.kind)]
    torch.manual_seed(0)
    img = torch.rand(n, 3, 32, 32)
    cases.append(("resnet18/32x32x3", build_model("resnet18", (3, 32, 32), 10), img, "image"))
    print(f"\n{'scoring':<22} {'cands':>6} {'views':>6} {'batched ms':>11} "
          f"{'per-view ms':>12} {'speedup':>8}")
    for name, model, xs, kind in cases:
        s = scoring_speed(model, xs, kind, repeats)
        report["scoring"][name] = s
        print(f"{name:<22} {s['candidates']:6d} {s['views']:6d} {1000 * s['batched_s']:11.1f} "
              f"{1000 * s['per_view_s']:12.1f} {s['speedup']:7.2f}x")
    return report


def run_bench(what: str, cfg: RunConfig, out: Path, repeats: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    report = {"client": bench_client}[what](cfg, out, repeats)
    report["torch"] = torch.__version__
    report["threads"] = torch.get_num_threads()
    path = out / f"bench_{what}.json"
    path.write_text(json.dumps(report, indent=1, default=_jsonable))
    print(f"\nwritten {path}")
    return 0


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))
