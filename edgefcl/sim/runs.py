"""`simulate`: one in-process run, lock-step or async on a virtual clock, by the config's mode."""

from __future__ import annotations

from collections.abc import Callable

from edgefcl.config import RunConfig
from edgefcl.learn.client import Client
from edgefcl.outcomes.results import RunResult
from edgefcl.sim.asynchronous import simulate_async
from edgefcl.sim.lockstep import simulate_lockstep


def simulate(cfg: RunConfig, method: str | None = None, seed: int | None = None,
             progress: Callable[[int, int, str], None] | None = None,
             observe: Callable[[Client], None] | None = None) -> RunResult:
    """Run one in-process simulation of `cfg` (lock-step, or async on a virtual clock with the
    run's timing profile) and return its result. `method` and `seed` override the config's;
    `progress(done, total, label)` is called as it goes; `observe` is called with every client
    once it is built (benchmarks attach their probes). The same config and seed give the same
    `global_sha256`."""
    method = method or cfg.learn.method
    seed = cfg.seed if seed is None else seed
    run = simulate_async if cfg.fed.mode == "async" else simulate_lockstep
    return run(cfg, method, seed, progress, observe)
