"""Runs one or many simulations (methods x seeds) with progress output."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

from edgefcl.config import RunConfig, run_entries
from edgefcl.outcomes.environment import environment
from edgefcl.outcomes.results import RunResult
from edgefcl.sim.runs import simulate

Progress = Callable[[int, int, str], None]


def total_runs(cfg: RunConfig) -> int:
    """How many runs `--compare` x `--seeds` makes."""
    return len(run_entries(cfg)) * cfg.seeds


def run_many(cfg: RunConfig, on_done: Callable[[RunResult], None] | None = None,
             done: dict[tuple[str, int], RunResult] | None = None) -> list[RunResult]:
    """Every entry of `--compare` (or `--method`) for `--seeds` seeds starting at `--seed`; an
    entry 'bi+gaussian/conflation' runs method bi with encoding gaussian and aggregation
    conflation, and its results carry the entry as their method label. `on_done` gets each
    run as soon as it finishes; runs found in `done` ((label, seed) -> result) are kept and not
    run again."""
    results = []
    done = done or {}
    total = total_runs(cfg)
    for label, method, fed in run_entries(cfg):
        run_cfg = dataclasses.replace(cfg, fed=fed, compare=label)  # (this entry's alone: an
        # apc entry's encoding is no other entry's)
        for seed in range(cfg.seed, cfg.seed + cfg.seeds):
            if (label, seed) in done:
                results.append(done[(label, seed)])
                continue
            position = f"run {len(results) + 1}/{total}" if total > 1 else None
            result = run_one(run_cfg, method, seed, label, position)
            result.method = label
            results.append(result)
            if on_done is not None:
                on_done(result)
    return results


def run_one(cfg: RunConfig, method: str, seed: int, label: str | None = None,
            position: str | None = None) -> RunResult:
    """One run with progress on stderr (unless quiet): a bar on a terminal, a plain line every
    10 s otherwise; `label` names it (default: the method), `position` its place in a sweep
    ("run 3/8"). Its results get `environment`."""
    label = label or method
    if cfg.transport == "mqtt":
        from edgefcl.runtime.fleet_processes import simulate_mqtt

        def sim(c: RunConfig, m: str, s: int, p: Progress | None = None) -> RunResult:
            name = label.replace("/", "-")
            workdir = Path(c.out) / "fleet" / f"{name}-seed{s}" if c.out else None
            return simulate_mqtt(c, m, s, workdir=workdir, progress=p)
    else:
        sim = simulate
    env = environment()
    desc = f"{label} seed {seed}" + (f" ({position})" if position else "")
    reporter = None if cfg.quiet else progress_reporter(desc)
    try:
        result = sim(cfg, method, seed, reporter)
    finally:
        if reporter is not None:
            reporter.close()
    result.extra["environment"] = env
    if cfg.transport == "mqtt":  # the fleet's own broker and fleet name are not the user's
        result.config["mqtt"] = dataclasses.asdict(cfg.mqtt)
    result.config["mqtt"]["password"] = ""  # never written to results or config.toml
    return result


def progress_reporter(desc: str, stream=None, every_s: float = 10.0) -> Progress:
    """A progress callback (done, total, status): a tqdm bar when `stream` (default stderr) is a
    terminal, else one plain line every `every_s` seconds (no carriage-return floods in logs).
    Call `.close()` at the end."""
    stream = stream or sys.stderr
    if stream.isatty():
        return _BarProgress(desc, stream)
    return _LineProgress(desc, stream, every_s)


class _BarProgress:
    def __init__(self, desc: str, stream) -> None:
        self.desc, self.stream, self.bar = desc, stream, None

    def __call__(self, done: int, total: int, status: str) -> None:
        if self.bar is None:  # created on the first tick, so set-up errors print cleanly
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=self.desc, unit="batch",
                            file=self.stream, leave=False, dynamic_ncols=True)
        self.bar.total = total or None
        self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(done - self.bar.n)  # redrawn at most every 0.1 s, with a smoothed rate

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _LineProgress:
    def __init__(self, desc: str, stream, every_s: float) -> None:
        self.desc, self.stream, self.every_s = desc, stream, every_s
        self.start = self.next_at = time.monotonic()
        self.last: tuple[int, int, str] | None = None

    def __call__(self, done: int, total: int, status: str) -> None:
        self.last = (done, total, status)
        now = time.monotonic()
        if now >= self.next_at + self.every_s:
            self.next_at = now
            self._line()

    def _line(self) -> None:
        done, total, status = self.last
        pct = f" ({100 * done / total:.0f} %)" if total else ""
        print(f"{self.desc}: {done}/{total or '?'} batches{pct}, {status}, "
              f"{time.monotonic() - self.start:.0f} s", file=self.stream, flush=True)

    def close(self) -> None:
        pass
