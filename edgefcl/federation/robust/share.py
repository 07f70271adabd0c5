"""Weight share cap: no client's sample weight may exceed `cap` of the round's total weight
(`fed.max_share`; 0: twice an equal share, 2 / participants; never below an equal share).
Weights above the cap are lowered by water-filling so that the capped shares are exactly `cap`;
an update's `num_samples` and class counts are scaled by the same factor. The arithmetic lives
in `federation/share_cap.py` (below the messages, so the prototype library uses it too):
`capped_groups` is the same cap within groups: the prototype library caps each label's rows
(one per device that sent the label) so that no device owns a row others also hold."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.share_cap import capped_groups, capped_weights  # noqa: F401


def apply(updates: list[Update], global_: Tensors, fed: FedConfig,
          counters: Counter, form: str = "dense") -> list[Update]:
    if fed.max_share >= 1 or len(updates) < 2:
        return updates
    cap = fed.max_share if fed.max_share > 0 else 2.0 / len(updates)
    w = np.array([max(u.num_samples, 1) for u in updates], np.float64)
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
