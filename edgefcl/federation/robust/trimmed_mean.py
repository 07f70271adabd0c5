"""Coordinate-wise trimmed mean of dense updates (`--aggregation trimmed-mean`): per entry, the
`fed.trim` fraction of the largest and of the smallest client values is dropped and the rest
averaged (unweighted). With n clients, up to floor(trim * n) faulty ones are ignored."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.robust.median import CoordinateMedian


class TrimmedMean(CoordinateMedian):
    """Mean of the middle values of every entry, mixed with the previous global."""

    def combine(self, stack: np.ndarray) -> np.ndarray:
        n = stack.shape[0]
        k = min(int(self.fed.trim * n), (n - 1) // 2)
        return np.sort(stack, axis=0)[k:n - k].mean(axis=0)
