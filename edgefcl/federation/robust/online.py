"""Online robust rules for async rounds that fold each update on arrival: the round's
statistics (median norm, total weight, median sigma) are unknown when an update arrives, so
each rule reads a bounded window of recent accepted updates instead (memory independent of the
number of clients). `StreamRules.apply` runs clipping, sigma floor and share cap, in that order,
on one update before the strategy folds it.

- clipping: tau = `clip_norm` when set, else `clip_factor` x the median of the last `WINDOW`
  delta norms, the current update's included;
- sigma floor: per `::sigma` tensor, `sigma_floor` x the median over the window of each
  update's median informative sigma (a scalar per tensor, the current update's included);
- share cap: weight capped at `factor` x the median of the last `WINDOW` weights (the current
  included), factor 2 by default (`max_share` 0: twice a typical client, as the round rule's
  twice an equal share), else `max(1, max_share x min_clients)`.
The first update after a start has no reference and passes unchanged (admission's sample bound
still holds).
"""

from __future__ import annotations

import warnings
from collections import Counter, deque
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.robust.clipping import clip
from edgefcl.federation.robust.sigma_floor import NO_INFORMATION, SIGMA

WINDOW = 64
"""Recent accepted updates the online rules read."""


def share_factor(fed: FedConfig) -> float:
    """How many times the median recent weight one update may count."""
    return 2.0 if fed.max_share <= 0 else max(1.0, fed.max_share * fed.min_clients)


def typical_sigma(t: np.ndarray) -> float:
    """Median of the informative entries of a sigma tensor (NaN when there are none)."""
    v = np.asarray(t, np.float64).ravel()
    v = v[v < NO_INFORMATION]
    return float(np.median(v)) if v.size else float("nan")


def delta_norm(tensors: Tensors, global_: Tensors) -> float:
    """L2 norm of tensors - global over the float tensors they share (float64; einsum, not
    BLAS: one update at a time between network reads, where waking BLAS threads costs more
    than the sum)."""
    total = 0.0
    for k, t in tensors.items():
        g = global_.get(k)
        if g is not None and t.dtype.kind == "f" and t.shape == g.shape:
            d = np.subtract(t, g, dtype=np.float64).ravel()
            total += float(np.einsum("i,i->", d, d))
    return float(np.sqrt(total))


class StreamRules:
    """Windows of recent norms, weights and sigmas; `apply` returns the guarded update."""

    def __init__(self, fed: FedConfig, window: int = WINDOW) -> None:
        self.fed = fed
        self.norms: deque[float] = deque(maxlen=window)
        self.weights: deque[float] = deque(maxlen=window)
        self.sigmas: dict[str, deque[float]] = {}
        self.window = window

    def apply(self, u: Update, global_: Tensors, counters: Counter) -> Update:
        u = self.clip(u, global_, counters)
        u = self.floor(u, counters)
        return self.cap(u, counters)

    def clip(self, u: Update, global_: Tensors, counters: Counter) -> Update:
        fed = self.fed
        if fed.encoding != "dense" or (fed.clip_norm <= 0 and fed.clip_factor <= 0):
            return u
        n = delta_norm(u.tensors, global_)
        self.norms.append(n)
        tau = fed.clip_norm if fed.clip_norm > 0 else fed.clip_factor * float(
            np.median(self.norms))
        if n > tau:
            counters["clipped"] += 1
            u = clip(u, global_, tau, n)
        return u

    def floor(self, u: Update, counters: Counter) -> Update:
        fed = self.fed
        if fed.encoding != "gaussian" or fed.sigma_floor <= 0:
            return u
        floors = {}
        for k, t in u.tensors.items():
            if k.endswith(SIGMA):
                s = typical_sigma(t)
                win = self.sigmas.setdefault(k, deque(maxlen=self.window))
                if np.isfinite(s):
                    win.append(s)
                if win:
                    floors[k] = fed.sigma_floor * float(np.median(win))
        low = sum(int((u.tensors[k] < f).sum()) for k, f in floors.items())
        if low:
            counters["sigma_floored"] += low
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                u = replace(u, tensors={k: (np.maximum(t, floors[k]).astype(t.dtype)
                                            if k in floors else t)
                                        for k, t in u.tensors.items()})
        return u

    def cap(self, u: Update, counters: Counter) -> Update:
        if self.fed.max_share >= 1:
            return u
        w = float(max(u.num_samples, 1))
        self.weights.append(w)
        bound = share_factor(self.fed) * float(np.median(self.weights))
        if w > bound:
            counters["share_capped"] += 1
            f = bound / w
            counts = (None if u.class_counts is None
                      else {c: n * f for c, n in u.class_counts.items()})
            u = replace(u, num_samples=bound, class_counts=counts)
        return u
