"""Aggregation strategies: validate one encoding's payload and fold it into running sums
(memory independent of the client count), then produce the next global.

A strategy is chosen by (encoding, aggregation) through `make_strategy`; new encodings register
their strategies in `STRATEGIES`. `result(previous)` returns the new global tensors already mixed
with the previous global.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edgefcl.federation.messages import Tensors, Update

Spec = dict[str, tuple[int, ...]]
"""Global tensor name -> shape."""


class WeightedSum:
    """Running sum of weight * tensors, accumulated in float64."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] | None = None
        self.weight = 0.0

    def add(self, tensors: Tensors, weight: float) -> None:
        if self.sums is None:
            self.sums = {k: np.zeros(v.shape, np.float64) for k, v in tensors.items()}
        for k, v in tensors.items():
            self.sums[k] += weight * v.astype(np.float64, copy=False)
        self.weight += weight

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean, float64."""
        if self.sums is None or self.weight <= 0:
            raise ValueError("no contributions to average")
        return {k: v / self.weight for k, v in self.sums.items()}


def mix(new: dict[str, np.ndarray], previous: Tensors, weight: float) -> Tensors:
    """weight * new + (1 - weight) * previous, as float32 (the paper's 0.5/0.5 smoothing)."""
    return {
        k: (weight * new[k] + (1.0 - weight) * previous[k].astype(np.float64)).astype(np.float32)
        for k in previous
    }


def check_dense(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject a dense payload: names, shapes, dtype, finiteness."""
    if set(tensors) != set(spec):
        return "names"
    for k, t in tensors.items():
        if t.shape != spec[k]:
            return "shape"
        if t.dtype != np.float32:
            return "dtype"
        if not np.isfinite(t).all():
            return "nonfinite"
    return None


class Strategy:
    """Base of all strategies: one instance accumulates one round.

    `decomposable` strategies can split a round over shards: `partial()` is what this
    instance accumulated (float64 sums and their weights, msgpack-able), and `merge(partial)`
    adds another instance's partial, so that merging the partials of disjoint sets of updates
    gives the result of adding all of them to one instance (up to float64 rounding).
    """

    encoding = "dense"
    decomposable = False

    def __init__(self, mix_weight: float = 0.5) -> None:
        self.mix_weight = mix_weight

    def check(self, update: Update, spec: Spec) -> str | None:
        return check_dense(update.tensors, spec)

    def add(self, update: Update) -> None:
        raise NotImplementedError

    def result(self, previous: Tensors) -> Tensors:
        raise NotImplementedError


class FedAvg(Strategy):
    """FedAvg weighted by the samples each client saw in its current task."""

    decomposable = True

    def __init__(self, mix_weight: float = 0.5) -> None:
        super().__init__(mix_weight)
        self.acc = WeightedSum()

    def add(self, update: Update) -> None:
        self.acc.add(update.tensors, float(max(update.num_samples, 1)))

    def result(self, previous: Tensors) -> Tensors:
        return mix(self.acc.mean(), previous, self.mix_weight)

    def partial(self) -> dict:
        """{"weight": w, "sums": {name: float64 sum of w * tensor}}."""
        return {"weight": self.acc.weight, "sums": dict(self.acc.sums or {})}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`."""
        merge_weighted_sum(self.acc, partial)


class ClassWeightedFedAvg(Strategy):
    """'Weighted FedAvg': average the models per class present in the round (weighted by the
    client's samples of that class), then average the class models equally."""

    decomposable = True

    def __init__(self, mix_weight: float = 0.5) -> None:
        super().__init__(mix_weight)
        self.per_class: dict[int, WeightedSum] = {}

    def add(self, update: Update) -> None:
        counts = update.class_counts or {-1: update.num_samples}
        for c, n in sorted(counts.items()):
            if n > 0:
                self.per_class.setdefault(int(c), WeightedSum()).add(update.tensors, float(n))

    def result(self, previous: Tensors) -> Tensors:
        if not self.per_class:
            raise ValueError("no contributions to average")
        means = [self.per_class[c].mean() for c in sorted(self.per_class)]
        avg = {k: sum(m[k] for m in means) / len(means) for k in means[0]}
        return mix(avg, previous, self.mix_weight)

    def partial(self) -> dict:
        """{"classes": {class: {"weight": w, "sums": {...}}}} (class ids as strings)."""
        return {"classes": {str(c): {"weight": a.weight, "sums": dict(a.sums or {})}
                            for c, a in sorted(self.per_class.items())}}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`, class by class."""
        for c, p in sorted(partial["classes"].items(), key=lambda kv: int(kv[0])):
            merge_weighted_sum(self.per_class.setdefault(int(c), WeightedSum()), p)


def merge_weighted_sum(acc: WeightedSum, partial: dict) -> None:
    """Add a partial {"weight", "sums"} into `acc` (no-op for an empty one)."""
    if not partial["sums"]:
        return
    if acc.sums is None:
        acc.sums = {k: np.zeros(np.shape(v), np.float64) for k, v in partial["sums"].items()}
    for k, v in partial["sums"].items():
        acc.sums[k] += np.asarray(v, np.float64)
    acc.weight += float(partial["weight"])


STRATEGIES: dict[tuple[str, str], Callable[[float], Strategy]] = {
    ("dense", "fedavg"): FedAvg,
    ("dense", "class-weighted"): ClassWeightedFedAvg,
}


def make_strategy(encoding: str, aggregation: str, mix_weight: float = 0.5) -> Strategy:
    """A fresh accumulator for one round of `encoding` updates aggregated by `aggregation`."""
    try:
        return STRATEGIES[(encoding, aggregation)](mix_weight)
    except KeyError:
        known = ", ".join(f"{e}/{a}" for e, a in sorted(STRATEGIES))
        raise ValueError(f"no aggregation '{aggregation}' for encoding '{encoding}'; "
                         f"known: {known}") from None
