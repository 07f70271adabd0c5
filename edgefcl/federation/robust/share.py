"""Weight share cap: no client's sample weight may exceed `cap` of the round's total weight
(`fed.max_share`; 0: twice an equal share, 2 / participants; never below an equal share).
Weights above the cap are lowered by water-filling so that the capped shares are exactly `cap`;
an update's `num_samples` and class counts are scaled by the same factor."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update


def capped_weights(weights: np.ndarray, cap: float) -> np.ndarray:
    """Weights whose shares are all <= cap (cap >= 1/len); unchanged when already so."""
    w = np.asarray(weights, np.float64)
    n = len(w)
    cap = max(cap, 1.0 / n)
    if n == 0 or w.sum() <= 0 or (w / w.sum()).max() <= cap:
        return w
    order = np.argsort(-w)
    for k in range(1, n + 1):  # clamp the k largest to cap * total
        rest = w[order[k:]].sum()
        total = rest / (1.0 - k * cap) if k * cap < 1 else np.inf
        if k == n or w[order[k]] <= cap * total:
            out = w.copy()
            out[order[:k]] = cap * total if np.isfinite(total) else 1.0
            return out
    return w


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
