"""Runs one or many simulations (methods x seeds) with progress output."""

from __future__ import annotations

import sys

from tqdm import tqdm

from edgefcl.config import RunConfig
from edgefcl.simulate import RunResult, simulate


def methods_of(cfg: RunConfig) -> list[str]:
    return [m.strip() for m in cfg.compare.split(",") if m.strip()] or [cfg.learn.method]


def run_many(cfg: RunConfig) -> list[RunResult]:
    """Every method of `--compare` (or `--method`) for `--seeds` seeds starting at `--seed`."""
    results = []
    for method in methods_of(cfg):
        for seed in range(cfg.seed, cfg.seed + cfg.seeds):
            results.append(run_one(cfg, method, seed))
    return results


def run_one(cfg: RunConfig, method: str, seed: int) -> RunResult:
    """One run with a progress bar on stderr (unless quiet)."""
    if cfg.transport == "mqtt":
        from edgefcl.runtime.fleet import simulate_mqtt

        sim = lambda c, m, s, p=None: simulate_mqtt(c, m, s, progress=p)  # noqa: E731
    else:
        sim = simulate
    if cfg.quiet:
        return sim(cfg, method, seed)
    bar = tqdm(total=0, desc=f"{method} seed {seed}", unit="batch", file=sys.stderr,
               leave=False, dynamic_ncols=True)

    def progress(done: int, total: int, status: str) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(status, refresh=False)
        bar.refresh()

    try:
        return sim(cfg, method, seed, progress)
    finally:
        bar.close()
