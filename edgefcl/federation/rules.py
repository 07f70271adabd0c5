"""The registry of aggregation rules for dense-form updates (the `dense` encoding and every
encoding that decodes to whole float32 tensors, such as `q8`). One line per rule; each rule is
a `Strategy` in its own module. Rules of other forms are listed by their encoding (gaussian,
sparse, apc)."""

from __future__ import annotations

from edgefcl.federation.robust.median import CoordinateMedian
from edgefcl.federation.robust.trimmed_mean import TrimmedMean
from edgefcl.federation.strategy import ClassWeightedFedAvg, FedAvg, Strategy

DENSE_RULES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg,
    "class-weighted": ClassWeightedFedAvg,
    "median": CoordinateMedian,
    "trimmed-mean": TrimmedMean,
}
