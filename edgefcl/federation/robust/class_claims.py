"""Class claims bound: a rule that weighs by class (`Strategy.weights_by_class`:
class-weighted) keeps one float64 model per class id of the round, and class ids are a
device's claim. An update claiming 1,500 invented classes (within the sample limit) made the
round hold 1,500 models: 1.5 GiB for a 0.25 MiB model, whatever the share cap, which bounds
weights, not memory (and `max_share 1` turns it off).

An honest update claims the classes of its current task's mini-batches. So an update
claiming more than CLASS_SLACK x the reference claim (and more than CLASS_FLOOR) has its
classes folded into one class of its own: it keeps its samples and its place in the round,
and the round holds a model for it, not one per claim (`class_claims_bounded`). The
reference is the lower median of the batch's claims and the RECENT claims of earlier
batches (`memory`, as clipping's norms): an inflated claim does not raise its own bound
unless it is half of what the rule sees. Rounds within the bound are unchanged, bit for bit.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.strategy import Strategy

CLASS_SLACK = 4
"""How many times the reference claim an update may claim."""
CLASS_FLOOR = 8
"""Claims up to this many classes always pass (a device between two tasks holds both)."""
RECENT = 32
"""Claims of earlier batches the reference also takes (as many as a saved memory keeps)."""
OWN_CLASS = -1
"""The class an over-claiming update's samples are folded into."""


def claim_bound(claims: list[int], recent: deque[int]) -> int:
    """The most classes one update may claim: CLASS_SLACK x the lower median of `claims` and
    `recent`, at least CLASS_FLOOR."""
    pool = np.asarray([*claims, *recent], np.int64)
    ref = int(np.percentile(pool, 50, method="lower")) if pool.size else 0
    return max(CLASS_SLACK * ref, CLASS_FLOOR)


def apply(updates: list[Update], global_: Tensors, fed: FedConfig,
          counters: Counter, form: str = "dense", memory: dict | None = None,
          strategy: Strategy | None = None) -> list[Update]:
    """Fold the classes of an update claiming more than `claim_bound` into one (rules that
    weigh by class only); `memory` keeps the recent claims."""
    if strategy is None or not strategy.weights_by_class or not updates:
        return updates
    claims = [len(u.class_counts) if u.class_counts else 1 for u in updates]
    recent: deque[int] = deque(maxlen=RECENT) if memory is None else memory.setdefault(
        "class_claims", deque(maxlen=RECENT))
    bound = claim_bound(claims, recent)
    recent.extend(min(c, bound) for c in claims)
    out = []
    for u, n in zip(updates, claims, strict=True):
        if n > bound:
            counters["class_claims_bounded"] += 1
            u = replace(u, class_counts={OWN_CLASS: float(sum(u.class_counts.values()))})
        out.append(u)
    return out
