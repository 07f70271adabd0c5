"""Prototype libraries on the wire and at the aggregator (FedBNN §IV-B, Algorithm 1 line 11).

A library maps label NAMES to classifier rows (weight and bias of the class's output unit,
width d + 1) with the number of samples of that label behind the row. Devices send the rows of
the labels they trained on; the aggregator averages the rows per label, weighted by that
label's samples, mixes each with the previous global's row of the same label (the same
smoothing as the other tensors) and publishes the whole library with the global, so a device
learns of labels it has never met.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgefcl.config import RunConfig, resolve_head

MAX_LABELS = 1024
"""Labels one library (an update or the global) may hold."""
MAX_LABEL_CHARS = 64
"""Characters of one label name."""


@dataclass(frozen=True)
class PrototypeTable:
    """Label names, their rows (n, width) float32 and their sample counts (n,) int64."""

    labels: tuple[str, ...]
    rows: np.ndarray
    counts: np.ndarray

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    @classmethod
    def empty(cls, width: int) -> PrototypeTable:
        return cls((), np.zeros((0, width), np.float32), np.zeros(0, np.int64))

    def row_of(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.labels)}


def feature_width(tensors: dict[str, np.ndarray]) -> int:
    """Row width (d + 1) of the prototype library of an extractor, read from its global
    tensors: d is the output size of its last layer with a weight matrix or kernel (the last
    tensor of two or more dimensions in state order; MLP, CNN and ResNet extractors, dense or
    Gaussian). The aggregator daemon uses it when it starts from saved tensors."""
    mats = [t for t in tensors.values() if np.ndim(t) >= 2]
    if not mats:
        raise ValueError("no weight matrix in the initial tensors: cannot size the prototypes")
    return int(np.shape(mats[-1])[0]) + 1


def initial_library(cfg: RunConfig, initial: dict[str, np.ndarray]) -> PrototypeTable | None:
    """The first global library of a run (empty), or None for a fixed head."""
    if resolve_head(cfg.learn.head, cfg.learn.method) != "prototypes":
        return None
    return PrototypeTable.empty(feature_width(initial))


def check_table(table: object, width: int | None) -> str | None:
    """Reason to reject a library from a device (None: acceptable). Bounds first (count, name
    length), then types, shapes, duplicates and finiteness; `width` None skips the width check."""
    if not isinstance(table, PrototypeTable):
        return "prototypes"
    labels, rows, counts = table.labels, table.rows, table.counts
    if not isinstance(labels, tuple) or len(labels) > MAX_LABELS:
        return "prototype_count"
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_LABEL_CHARS for s in labels):
        return "prototype_label"
    if len(set(labels)) != len(labels):
        return "prototype_duplicate"
    if not isinstance(rows, np.ndarray) or not isinstance(counts, np.ndarray):
        return "prototype_shape"
    if rows.ndim != 2 or rows.shape[0] != len(labels) or counts.shape != (len(labels),):
        return "prototype_shape"
    if width is not None and rows.shape[1] != width:
        return "prototype_shape"
    if rows.dtype != np.float32 or counts.dtype.kind not in "iu":
        return "prototype_dtype"
    if not np.isfinite(rows).all():
        return "nonfinite"
    if (counts < 0).any():
        return "prototype_count"
    return None


def average_tables(tables: Sequence[PrototypeTable], previous: PrototypeTable,
                   mix_weight: float) -> PrototypeTable:
    """The next global library: per label, the sample-weighted mean of the rows sent (labels
    with zero samples in this round weigh equally), mixed `mix_weight : 1 - mix_weight` with the
    previous global's row where the label already had one; labels nobody sent keep their row.
    Labels keep the previous order, new ones follow in sorted order (deterministic); past
    MAX_LABELS the newest are left out."""
    sent = [t for t in tables if t.labels]
    if not sent:
        return previous
    labels = np.array([s for t in sent for s in t.labels], dtype=object)
    rows = np.concatenate([t.rows for t in sent]).astype(np.float64)
    counts = np.concatenate([t.counts for t in sent]).astype(np.float64)
    names, inverse = np.unique(labels.astype(str), return_inverse=True)
    weight = np.bincount(inverse, weights=counts, minlength=len(names))
    equal = weight[inverse] <= 0  # a label nobody counted: plain mean of its rows
    w = np.where(equal, 1.0, counts)
    sums = np.zeros((len(names), rows.shape[1]))
    np.add.at(sums, inverse, w[:, None] * rows)
    mean = sums / np.bincount(inverse, weights=w, minlength=len(names))[:, None]
    old = previous.row_of()
    out_labels = list(previous.labels) + [str(n) for n in names if n not in old]
    out_rows = np.concatenate([previous.rows.astype(np.float64),
                               np.zeros((len(out_labels) - len(old), rows.shape[1]))])
    out_counts = np.concatenate([previous.counts.astype(np.int64),
                                 np.zeros(len(out_labels) - len(old), np.int64)])
    index = {n: i for i, n in enumerate(out_labels)}
    at = np.array([index[str(n)] for n in names])  # one lookup per label, not per sample
    had = np.array([str(n) in old for n in names])
    out_rows[at] = np.where(had[:, None], mix_weight * mean + (1 - mix_weight) * out_rows[at],
                            mean)
    out_counts[at] += weight.astype(np.int64)
    keep = min(len(out_labels), MAX_LABELS)  # the global stays within what devices accept
    return PrototypeTable(tuple(out_labels[:keep]), out_rows[:keep].astype(np.float32),
                          out_counts[:keep])
