"""Coordinate-wise median of dense updates (`--aggregation median`): each entry of the new
global is the median of the clients' values, so fewer than half the clients cannot move it
outside the honest range. Keeps the round's tensors (memory grows with the participants). A
point prototype library's rows are combined per label by the same estimator."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.strategy import Strategy


class CoordinateMedian(Strategy):
    """Coordinate-wise median (unweighted), mixed with the previous global."""

    def reset(self) -> None:
        self.tensors: list[Tensors] = []

    def add(self, update: Update) -> None:
        self.tensors.append(update.tensors)

    def combine(self, stack: np.ndarray) -> np.ndarray:
        return np.median(stack, axis=0)

    def row_combiner(self) -> Callable[[np.ndarray], np.ndarray]:
        """Prototype rows per label by the same estimator (median, or the trimmed mean)."""
        return self.combine

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray], None]:
        if not self.tensors:
            raise ValueError("no contributions to aggregate")
        return {k: self.combine(np.stack([t[k].astype(np.float64) for t in self.tensors]))
                for k in previous}, None
