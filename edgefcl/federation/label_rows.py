"""Label rows: the classes of a library head (`heads.Head.library`) on the wire, in a global
and in saved state.

A library maps label NAMES to classifier rows (weight and bias of the class's output unit,
width d + 1) with the number of samples of that label behind the row; a Gaussian library also
has a sigma row per label (`sigmas`, > 0, the rows' shape). Devices send the rows of the labels
they trained on and receive the whole library with each global, so a device learns of labels
it has never met. This module is the data and its checks only: how rows are made, folded and
mixed is the head's own rule, registered in `federation/heads.py`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgefcl.data.labels import MAX_LABELS, valid_name
from edgefcl.federation.value_bound import MAX_VALUE

MAX_COUNT = 1 << 40
"""Samples one label's row may claim (an update's) and the most a global row counts (sums
saturate there, so that no int64 overflows: a wrapped count would be negative, and every
device would reject the global)."""
LABELS_KEY, ROWS_KEY, COUNTS_KEY = "prototypes::labels", "prototypes::rows", "prototypes::counts"
"""Names of the library's arrays where it is saved next to a global's tensors (the aggregator's
state, global.npz): labels as UTF-8 JSON bytes (exact round trip of any name), rows, counts."""
SIGMAS_KEY = "prototypes::sigmas"
"""The sigma rows of a Gaussian library (absent for point libraries)."""
SIGMA_MIN = 1e-5
"""Smallest sigma a library publishes (`federation.gaussian.SIGMA_MIN`)."""


@dataclass(frozen=True)
class LabelRows:
    """Label names, their rows (n, width) float32 and their sample counts (n,) int64; a
    Gaussian library also has the rows' sigmas (n, width) float32 > 0 (None: point rows)."""

    labels: tuple[str, ...]
    rows: np.ndarray
    counts: np.ndarray
    sigmas: np.ndarray | None = None

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    @property
    def gaussian(self) -> bool:
        return self.sigmas is not None

    @classmethod
    def empty(cls, width: int, gaussian: bool = False) -> LabelRows:
        return cls((), np.zeros((0, width), np.float32), np.zeros(0, np.int64),
                   np.zeros((0, width), np.float32) if gaussian else None)

    def row_of(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.labels)}


def check_rows(table: object, width: int | None) -> str | None:
    """Reason to reject a library from a device (None: acceptable). Bounds first (count, name
    length), then types, shapes, duplicates, finiteness, magnitude (MAX_VALUE), counts
    (0..MAX_COUNT) and sigmas when present (float32 of the rows' shape, finite, in
    (0, MAX_VALUE]); `width` None skips the width check."""
    if not isinstance(table, LabelRows):
        return "prototypes"
    labels, rows, counts = table.labels, table.rows, table.counts
    if not isinstance(labels, tuple) or len(labels) > MAX_LABELS:
        return "prototype_count"
    if not all(valid_name(s) for s in labels):
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
    if rows.size and np.abs(rows).max() > MAX_VALUE:
        return "range"
    if (counts < 0).any() or (counts > MAX_COUNT).any():
        return "prototype_count"
    sigmas = table.sigmas
    if sigmas is None:
        return None
    if not isinstance(sigmas, np.ndarray) or sigmas.shape != rows.shape:
        return "prototype_shape"
    if sigmas.dtype != np.float32:
        return "prototype_dtype"
    if not np.isfinite(sigmas).all():
        return "nonfinite"
    if not (sigmas > 0).all():
        return "sigma"
    if sigmas.size and sigmas.max() > MAX_VALUE:
        return "range"
    return None


def rows_arrays(table: LabelRows | None) -> dict[str, np.ndarray]:
    """The library as named arrays (LABELS_KEY, ROWS_KEY, COUNTS_KEY and, for a Gaussian
    library, SIGMAS_KEY); empty for None."""
    if table is None:
        return {}
    names = json.dumps(list(table.labels), ensure_ascii=False).encode()
    out = {LABELS_KEY: np.frombuffer(names, np.uint8).copy(),
           ROWS_KEY: np.asarray(table.rows, np.float32),
           COUNTS_KEY: np.asarray(table.counts, np.int64)}
    if table.sigmas is not None:
        out[SIGMAS_KEY] = np.asarray(table.sigmas, np.float32)
    return out


def split_rows(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                          LabelRows | None]:
    """(the arrays other than the library's, the library or None): the inverse of
    `rows_arrays` merged into tensors. Raises ValueError for a partial or invalid library
    (`check_rows`, width not checked)."""
    keys = {k for k in arrays if k.startswith("prototypes::")}
    rest = {k: v for k, v in arrays.items() if k not in keys}
    if not keys:
        return rest, None
    if keys - {SIGMAS_KEY} != {LABELS_KEY, ROWS_KEY, COUNTS_KEY}:
        raise ValueError(f"a partial prototype library ({sorted(keys)})")
    raw = arrays[LABELS_KEY]
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError("prototype labels are not UTF-8 JSON bytes")
    try:
        labels = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, ValueError):
        raise ValueError("prototype labels are not UTF-8 JSON") from None
    if not isinstance(labels, list):
        raise ValueError("prototype labels are not a list")
    table = LabelRows(tuple(labels), arrays[ROWS_KEY], arrays[COUNTS_KEY],
                      arrays.get(SIGMAS_KEY))
    reason = check_rows(table, None)
    if reason is not None:
        raise ValueError(f"invalid prototype library ({reason})")
    return rest, table


def rows_digest(table: LabelRows) -> str:
    """sha256 over the library's names, dtypes, shapes and bytes (labels in library order;
    a Gaussian library's sigmas included)."""
    h = hashlib.sha256()
    for k, v in sorted(rows_arrays(table).items()):
        v = np.ascontiguousarray(v)
        h.update(f"{k}|{v.dtype.str}|{v.shape}".encode())
        h.update(v.tobytes())
    return h.hexdigest()
