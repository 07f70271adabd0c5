"""What a device checks before it adopts a global model.

The aggregator is trusted, the path to it is not (a stolen credential with a broken ACL, a
retained message left by a test, a buggy gateway). A device adopts a global only when every
tensor has exactly the name, shape and dtype of its own model's global (`expected`), all values
are finite and at most MAX_VALUE in magnitude, BatchNorm variances and Gaussian sigmas are
positive, and the version moves forward by at most `max_step`. APC globals may also carry the
knowledge base (`<name>::kb`, shape (K, *shape)) and its ring position (`apc::kb_next`, an
int64 scalar). A prototype library must pass `label_rows.check_rows` (MAX_VALUE too),
and have the device's row width and kind (Gaussian rows with sigmas, or point rows) where the
device merges it (`library_width`, `library_gaussian`). Its rows are bounded by the previous
global the device adopted, as the aggregator bounds senders' rows (`row_clip`): per version,
no row may move further than MAX_ROW_GROWTH x that global's median row norm
(`library_fault`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgefcl.federation.label_rows import LabelRows, check_rows
from edgefcl.federation.messages import GlobalModel
from edgefcl.federation.robust.variance import check_variances
from edgefcl.federation.sparse import KB
from edgefcl.federation.value_bound import MAX_VALUE

KB_NEXT = "apc::kb_next"
MAX_VERSION_STEP = 1_000_000
"""Largest version step a device accepts (an honest aggregator publishes one per round)."""

MAX_ROW_GROWTH = 10.0
"""How far, per version and x the median row norm of the previous global a device adopted,
a global's prototype row may lie from that global's row of its label: the aggregator clips
each row's change to `clip_factor` (3 by default) x that median, so an honest global moves a
row by at most that in one round. Larger `clip_factor`s widen it to 2 x theirs."""

Spec = dict[str, tuple[tuple[int, ...], str]]


def _optional(name: str, t: np.ndarray, expected: Spec) -> bool:
    if name == KB_NEXT:
        return t.shape == () and t.dtype == np.int64 and int(t) >= 0
    if name.endswith(KB) and name[: -len(KB)] in expected:
        shape, dt = expected[name[: -len(KB)]]
        return t.ndim == len(shape) + 1 and t.shape[1:] == shape and t.dtype.str == dt
    return False


def value_fault(name: str, t: np.ndarray) -> str | None:
    """Why a device rejects the values of global tensor `name`: not finite, beyond MAX_VALUE
    in magnitude, or a Gaussian sigma <= 0 (None: they pass)."""
    if t.dtype.kind == "f" and not np.isfinite(t).all():
        return "nonfinite"
    if t.dtype.kind == "f" and t.size and np.abs(t).max() > MAX_VALUE:
        return "range"
    if name.endswith("::sigma") and not (t > 0).all():
        return "sigma"
    return None


def global_fault(tensors: dict[str, np.ndarray]) -> str | None:
    """Why devices would reject a global with these tensors for their values (`value_fault`,
    then BatchNorm variances <= 0); None when they would take them. The aggregator checks
    every global it makes: updates are checked one by one, and some faults only show in
    their sum (variances through encoded keys the validator cannot read, a sparse entry
    pushed a little further at every round)."""
    for k, t in tensors.items():
        reason = value_fault(k, t)
        if reason is not None:
            return reason
    return check_variances(tensors)


def as_received(t: np.ndarray, wire_dtype: str | None) -> np.ndarray:
    """A tensor as devices decode it from a wire of `wire_dtype` (None: as sent): float32 goes
    as that dtype and back, which overflows float16 past 65504 and flushes tiny values to 0."""
    if wire_dtype is None or t.dtype != np.float32:
        return t
    with np.errstate(over="ignore", under="ignore"):
        return t.astype(wire_dtype).astype(np.float32)


def published_fault(g: GlobalModel, wire_dtype: str | None = None) -> str | None:
    """Why devices would reject global `g` for its values (`global_fault`) or its prototype
    library (`check_rows`), as they receive it over a wire of `wire_dtype`: a fault only the
    wire makes is `wire_<fault>`. None when they would take it."""
    for wire in (None, wire_dtype) if wire_dtype is not None else (None,):
        fault = global_fault({k: as_received(t, wire) for k, t in g.tensors.items()})
        table = g.prototypes
        if fault is None and table is not None:
            fault = check_rows(replace(table, rows=as_received(table.rows, wire), sigmas=(
                None if table.sigmas is None else as_received(table.sigmas, wire))), None)
        if fault is not None:
            return fault if wire is None else f"wire_{fault}"
    return None


def library_fault(table: LabelRows, previous: LabelRows | None, steps: int,
                  clip_factor: float = 3.0) -> str | None:
    """"prototype_norm" when a row of the global's library `table` lies further from the
    `previous` global's row of its label (the zero row for a new label) than `steps` (the
    versions between them, at least 1) x max(MAX_ROW_GROWTH, 2 x `clip_factor`) x the median
    norm of the previous rows; None when it fits, when there is no previous library with
    rows to measure against, or when the aggregator does not clip (`clip_factor` 0)."""
    if previous is None or not previous.labels or not table.labels or clip_factor <= 0:
        return None
    scale = float(np.median(np.linalg.norm(previous.rows.astype(np.float64), axis=1)))
    if not scale > 0:
        return None
    at = previous.row_of()
    base = np.zeros(table.rows.shape, np.float64)
    old = np.array([at.get(n, -1) for n in table.labels], np.int64)
    base[old >= 0] = previous.rows[old[old >= 0]]
    bound = max(1, steps) * max(MAX_ROW_GROWTH, 2 * clip_factor) * scale
    far = np.linalg.norm(table.rows.astype(np.float64) - base, axis=1) > bound
    return "prototype_norm" if far.any() else None


def check_global(g: GlobalModel, expected: Spec, held_version: int,
                 max_step: int = MAX_VERSION_STEP,
                 library_width: int | None = None,
                 library_gaussian: bool = False,
                 previous: GlobalModel | None = None, clip_factor: float = 3.0) -> str | None:
    """The reason to reject global `g` (a whole one, deltas resolved), or None. A version at
    or below `held_version` may be valid (a retained global re-delivered); the caller simply
    does not merge it. `library_width`: the row width of the library the device merges the
    global's into (None: the device does not merge one); `library_gaussian`: whether that
    library has Gaussian rows (the global's must then carry sigmas, and only then);
    `previous`: the last global the device adopted, whose library bounds this one's rows
    (`library_fault`, with the run's `clip_factor`; None: not checked)."""
    if g.version < 0 or g.version - held_version > max_step:
        return "version-jump"
    if any(k not in g.tensors for k in expected):
        return "names"
    for k, t in g.tensors.items():
        spec = expected.get(k)
        if spec is None:
            if not _optional(k, t, expected):
                return "names"
            continue
        if t.shape != spec[0]:
            return "shape"
        if t.dtype.str != spec[1]:
            return "dtype"
        reason = value_fault(k, t)
        if reason is not None:
            return reason
    if g.prototypes is not None:  # the prototype library
        reason = check_rows(g.prototypes, library_width)
        if reason is not None:
            return reason
        if library_width is not None and g.prototypes.gaussian != library_gaussian:
            return "prototype_sigma"
        reason = library_fault(g.prototypes, previous and previous.prototypes,
                               g.version - (previous.version if previous else 0), clip_factor)
        if reason is not None:
            return reason
    return check_variances({k: g.tensors[k] for k in expected})
