"""Fold rules: what an async round averages. One function per rule; `FOLDS` is the registry.

- model: the models as sent (FedAvg, the paper's rule). An update trained from an older
  global pulls the new one back toward where that client started.
- delta: each update's change since the global it was trained from, applied to the current
  global, x_i' = x_current + (x_i - x_base_i) (FedBuff, Nguyen et al. 2022); with `mix` as the
  server learning rate the round gives x_current + mix * mean_i(x_i - x_base_i). Statistics
  (BatchNorm running mean and variance) are not additive and keep the value sent.

Both act on decoded dense-form updates before the robust rules, so clipping, the share cap,
the median and the trimmed mean see the rebased updates (clipping: the client's own delta).
Other forms carry their own base: sparse deltas follow the rule in `SparseFedAvg._base`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edgefcl.federation.messages import Tensors, Update

STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
"""Suffixes of tensors that are statistics, not learned parameters (never rebased)."""

Bases = Callable[[int], Tensors | None]


def keep(updates: list[Update], current: Tensors, version: int, bases: Bases,
         counters: Counter) -> list[Update]:
    """The updates as sent."""
    return updates


def rebase(updates: list[Update], current: Tensors, version: int, bases: Bases,
           counters: Counter) -> list[Update]:
    """Each update's change since its base, applied to `current` (the global of `version`).
    An update whose base is no longer held is dropped (`rejected_base_gone`): the aggregator
    keeps `max_staleness + 1` globals, so only a resumed daemon meets one."""
    out = []
    for u in updates:
        if u.base_version == version:
            out.append(u)
            continue
        base = bases(u.base_version)
        if base is None:
            counters["rejected_base_gone"] += 1
            continue
        tensors = {k: v if k.endswith(STATISTICS) else
                   (current[k].astype(np.float64) + (v.astype(np.float64) - base[k]))
                   .astype(np.float32) for k, v in u.tensors.items()}
        counters["rebased"] += 1
        out.append(replace(u, tensors=tensors))
    return out


@dataclass(frozen=True)
class Fold:
    """One fold rule: `apply` to a round's decoded dense updates; `onto_current`: deltas of
    other forms are applied to the current global instead of their base."""

    name: str
    apply: Callable[[list[Update], Tensors, int, Bases, Counter], list[Update]]
    onto_current: bool


FOLDS = {f.name: f for f in (Fold("model", keep, False), Fold("delta", rebase, True))}
