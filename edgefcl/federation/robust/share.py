"""Weight share cap: no client's sample weight may exceed `cap` of the round's total weight
(`fed.max_share`; 0: twice an equal share, 2 / participants, but at most half, so that no
client outweighs all the others together; never below an equal share).
Weights above the cap are lowered by water-filling so that the capped shares are exactly `cap`;
an update's `num_samples` and class counts are scaled by the same factor. A rule that weighs by
class (`Strategy.weights_by_class`: class-weighted) gives an update its share of the class
models instead, which its sample count does not bound (an update claiming classes no one else
holds owns their models); there the cap holds on those shares. The arithmetic lives
in `federation/share_cap.py` (below the messages, so the prototype library uses it too):
`capped_groups` is the same cap within groups: the prototype library caps each label's rows
(one per device that sent the label) so that no device owns a row others also hold."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.share_cap import capped_groups, capped_weights, default_cap  # noqa: F401
from edgefcl.federation.strategy import Strategy, sample_weight


def class_shares(updates: list[Update]) -> np.ndarray:
    """Each update's share of a class-weighted average: the mean over the round's classes of
    its part of the class's samples (an update without class counts is one class, -1)."""
    counts = [u.class_counts or {-1: u.num_samples} for u in updates]
    totals: Counter = Counter()
    for c in counts:
        totals.update({k: n for k, n in c.items() if n > 0})
    return np.array([sum(n / totals[k] for k, n in c.items() if n > 0) for c in counts],
                    np.float64) / max(len(totals), 1)


def _cap_class_shares(updates: list[Update], cap: float, counters: Counter) -> list[Update]:
    """Class-weighted rounds: the average gives each update `class_shares`, whatever its
    sample count, so an update claiming classes no one else holds owns their class models.
    When a share is over the cap, every update becomes one common class weighted by its
    capped share (the class-weighted average of one class is the weighted mean)."""
    shares = class_shares(updates)
    new = capped_weights(shares, cap)
    if (new >= shares).all():
        return updates  # unchanged, bit for bit
    counters["share_capped"] += int((new < shares).sum())
    return [replace(u, class_counts={-1: float(w)}) for u, w in zip(updates, new, strict=True)]


def apply(updates: list[Update], global_: Tensors, fed: FedConfig,
          counters: Counter, form: str = "dense", memory: dict | None = None,
          strategy: Strategy | None = None) -> list[Update]:
    if fed.max_share >= 1 or len(updates) < 2:
        return updates
    cap = fed.max_share if fed.max_share > 0 else default_cap(len(updates))
    if strategy is not None and strategy.weights_by_class:
        return _cap_class_shares(updates, cap, counters)
    w = np.array([sample_weight(u) for u in updates], np.float64)
    new = capped_weights(w, cap)
    out = []
    for u, a, b in zip(updates, w, new, strict=True):
        if b < a:
            counters["share_capped"] += 1
            f = b / a
            counts = (None if u.class_counts is None
                      else {c: n * f for c, n in u.class_counts.items()})
            u = replace(u, num_samples=float(b), class_counts=counts)
        out.append(u)
    return out
