"""Aggregation strategies as running weighted sums (memory independent of the client count)."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.messages import Tensors, Update


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


class FedAvg:
    """FedAvg weighted by the samples each client saw in its current task."""

    name = "fedavg"

    def __init__(self) -> None:
        self.acc = WeightedSum()

    def add(self, update: Update) -> None:
        self.acc.add(update.tensors, float(max(update.num_samples, 1)))

    def result(self) -> dict[str, np.ndarray]:
        return self.acc.mean()


class ClassWeightedFedAvg:
    """'Weighted FedAvg': average the models per class present in the round (weighted by the
    client's samples of that class), then average the class models equally."""

    name = "class-weighted"

    def __init__(self) -> None:
        self.per_class: dict[int, WeightedSum] = {}

    def add(self, update: Update) -> None:
        counts = update.class_counts or {-1: update.num_samples}
        for c, n in sorted(counts.items()):
            if n > 0:
                self.per_class.setdefault(int(c), WeightedSum()).add(update.tensors, float(n))

    def result(self) -> dict[str, np.ndarray]:
        if not self.per_class:
            raise ValueError("no contributions to average")
        means = [self.per_class[c].mean() for c in sorted(self.per_class)]
        return {k: sum(m[k] for m in means) / len(means) for k in means[0]}


STRATEGIES = {"fedavg": FedAvg, "class-weighted": ClassWeightedFedAvg}


def make_strategy(name: str) -> FedAvg | ClassWeightedFedAvg:
    """A fresh accumulator for one round."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown aggregation '{name}'; choose from {known}") from None


def mix(new: dict[str, np.ndarray], previous: Tensors, weight: float) -> Tensors:
    """weight * new + (1 - weight) * previous, as float32 (the paper's 0.5/0.5 smoothing)."""
    return {
        k: (weight * new[k] + (1.0 - weight) * previous[k].astype(np.float64)).astype(np.float32)
        for k in previous
    }
