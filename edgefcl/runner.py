"""Runs one or many simulations (methods x seeds) with progress output."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from tqdm import tqdm

from edgefcl.config import RunConfig, run_entries
from edgefcl.simulate import RunResult, simulate


def run_many(cfg: RunConfig) -> list[RunResult]:
    """Every entry of `--compare` (or `--method`) for `--seeds` seeds starting at `--seed`; an
    entry 'bi+gaussian/conflation' runs method bi with encoding gaussian and aggregation
    conflation, and its results carry the entry as their method label."""
    results = []
    for label, method, fed in run_entries(cfg):
        run_cfg = dataclasses.replace(cfg, fed=fed)
        for seed in range(cfg.seed, cfg.seed + cfg.seeds):
            result = run_one(run_cfg, method, seed, label)
            result.method = label
            results.append(result)
    return results


def run_one(cfg: RunConfig, method: str, seed: int, label: str | None = None) -> RunResult:
    """One run with a progress bar on stderr (unless quiet); `label` names it (default: the
    method)."""
    label = label or method
    if cfg.transport == "mqtt":
        from edgefcl.runtime.fleet import simulate_mqtt

        def sim(c: RunConfig, m: str, s: int, p=None) -> RunResult:
            name = label.replace("/", "-")
            workdir = Path(c.out) / "fleet" / f"{name}-seed{s}" if c.out else None
            return simulate_mqtt(c, m, s, workdir=workdir, progress=p)
    else:
        sim = simulate
    if cfg.quiet:
        return sim(cfg, method, seed)
    bars: list[tqdm] = []  # created on the first tick, so set-up errors print cleanly

    def progress(done: int, total: int, status: str) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc=f"{label} seed {seed}", unit="batch",
                             file=sys.stderr, leave=False, dynamic_ncols=True))
        bar = bars[0]
        bar.total = total or None
        bar.n = done
        bar.set_postfix_str(status, refresh=False)
        bar.refresh()

    try:
        return sim(cfg, method, seed, progress)
    finally:
        for bar in bars:
            bar.close()
