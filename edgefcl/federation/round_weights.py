"""Async round weights: an update's sample weight times its staleness weight s(tau) (the run's
`staleness` rule, FedAsync) and its task-lag weight `task_decay`^k (k: tasks its sender is
behind the round's newest task, `newest_task`; async only). Applied before the robust rules,
so the share cap bounds the weights as they are averaged: no device holds more than
`max_share` of a round whatever the others' staleness or tasks. The sample-weighted mean of s
also scales the round's mix (`Strategy.mix_weight`): a round of stale updates moves the global
less. With the constant rule and no task lag the updates pass unchanged (lock-step, bit for
bit)."""

from __future__ import annotations

from dataclasses import replace

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Update
from edgefcl.federation.staleness import Constant, staleness_rule
from edgefcl.federation.strategy import Strategy


def newest_task(tasks: list[int]) -> int:
    """The round's newest task for the task lag: the newest claimed, but at most one past the
    lower median claim (a task is a device's claim: one update claiming task 10^9 made every
    other weigh task_decay^(10^9), nothing, and held the whole round)."""
    ordered = sorted(tasks)
    return min(ordered[-1], ordered[(len(ordered) - 1) // 2] + 1)


def weigh(updates: list[Update], version: int, fed: FedConfig,
          strategy: Strategy) -> list[Update]:
    """The round's updates with their sample weight (`num_samples`, class counts) scaled;
    notes each update's staleness weight in `strategy` for the round's mix. `version`: the
    global the round replaces."""
    stale = staleness_rule(fed.staleness, fed.staleness_a, fed.staleness_b)
    decay = fed.task_decay if fed.mode == "async" else 1.0  # lock-step clients share a task
    if isinstance(stale, Constant) and decay == 1.0 or not updates:
        return updates
    newest = newest_task([u.task for u in updates])
    out = []
    for u in updates:
        s = stale(max(version - u.base_version, 0))
        strategy.note_freshness(float(u.num_samples), s)
        w = s * decay ** max(newest - u.task, 0)
        counts = None if u.class_counts is None else {c: n * w
                                                      for c, n in u.class_counts.items()}
        out.append(replace(u, num_samples=u.num_samples * w, class_counts=counts))
    return out
