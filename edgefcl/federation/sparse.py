"""Sparse parameter updates (NOTES.md §2): top-k / threshold selection of the delta to the base
global with error feedback, delta-coded indices, validation, and per-entry aggregation.

Wire format of one sparse tensor `w` (any float tensor of the global spec):
- `w::idx`: positions in the flattened tensor, delta-coded (the first one absolute, then the
  gaps to the previous one), in the smallest unsigned dtype that holds the largest gap;
- `w::rows`: the same for whole rows (first axis) instead of single entries;
- `w::val`: the values, float32 or float16; one per index, or one row each for `::rows`.
The entry count comes from the global spec, so it is never sent.

Encoding `sparse` sends, per weight tensor (2 or more axes), the delta to the global the
client last merged plus the error-feedback residual, keeping the `topk` fraction of largest
magnitudes (and, with `threshold` > 0, only entries at least that large); what was not sent is
carried to the next delta. Vectors (biases, normalisation parameters and statistics) travel
whole, as in Deep Gradient Compression: they are about 1% of a model, and BatchNorm statistics
sparsified apart from the weights they normalise break the global model in eval mode. The
aggregator turns each delta back into absolute values (see `SparseFedAvg`), averages every
entry over the clients that sent it and mixes with the previous global; entries nobody sent
keep their previous value.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.aggregation import STRATEGIES, Spec, Strategy
from edgefcl.federation.encodings import ENCODERS
from edgefcl.federation.messages import Tensors, Update

if TYPE_CHECKING:
    from edgefcl.federation.aggregator import Aggregator

IDX, ROWS, VAL = "::idx", "::rows", "::val"
SUFFIXES = {IDX: "idx", ROWS: "rows", VAL: "val"}
INDEX_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)
VALUE_DTYPES = {"float32": np.float32, "float16": np.float16}
F16_MAX = float(np.finfo(np.float16).max)


class SparseError(ValueError):
    """A sparse payload that cannot be used; `reason` is the short tag the aggregator counts
    (names, dtype, shape, length, index-range, index-duplicate, nonfinite, base)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


# -- indices ------------------------------------------------------------------------------------
def index_dtype(largest: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds `largest` (>= 0)."""
    for dt in INDEX_DTYPES:
        if largest <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"index {largest} does not fit in 64 bits")


def encode_indices(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions -> gaps (first one absolute) in the smallest uint dtype."""
    pos = np.asarray(positions, np.int64).ravel()
    gaps = np.diff(pos, prepend=0)
    if pos.size and (pos[0] < 0 or (gaps[1:] <= 0).any()):
        raise ValueError("positions must be non-negative and strictly increasing")
    return gaps.astype(index_dtype(int(gaps.max()) if gaps.size else 0))


def decode_indices(codes: np.ndarray, n: int) -> np.ndarray:
    """Gaps -> positions (int64), checked: every position in [0, n), strictly increasing.

    Raises SparseError("dtype" | "shape" | "index-range" | "index-duplicate").
    """
    if codes.dtype.kind != "u":
        raise SparseError("dtype", f"indices must be unsigned integers, got {codes.dtype}")
    if codes.ndim != 1:
        raise SparseError("shape", f"indices must be 1-D, got shape {codes.shape}")
    if codes.size == 0:
        return np.zeros(0, np.int64)
    if codes.size > n or int(codes.max()) >= n:
        raise SparseError("index-range", f"{codes.size} indices into {n} entries")
    # every gap < n and at most n gaps: the running sum stays below n * n (no overflow)
    pos = np.cumsum(codes, dtype=np.int64)
    if (codes[1:] == 0).any():
        raise SparseError("index-duplicate", "an index repeats (zero gap)")
    if pos[-1] >= n:
        raise SparseError("index-range", f"index {int(pos[-1])} >= {n} entries")
    return pos


# -- selection ----------------------------------------------------------------------------------
def select(values: np.ndarray, topk: float, threshold: float = 0.0) -> np.ndarray:
    """Sorted positions of the entries of 1-D `values` to send: the ceil(topk * n) largest
    magnitudes (all of them when topk is 0 or >= 1), restricted to |value| >= threshold."""
    mag = np.abs(values)
    n = mag.size
    k = n if topk <= 0 or topk >= 1 else min(n, max(1, math.ceil(topk * n)))
    if k < n:
        idx = np.argpartition(mag, n - k)[n - k:]
        idx.sort()
    else:
        idx = np.arange(n)
    if threshold > 0:
        idx = idx[mag[idx] >= threshold]
    return idx.astype(np.int64)


def pad_gaps(positions: np.ndarray, value_bytes: int) -> np.ndarray:
    """`positions` plus filler positions (every M-th entry inside gaps longer than M) so that
    the gaps fit a narrower index dtype, when that makes idx + values smaller.

    Fillers are real entries: the caller sends their true values. For a uint8 index
    (M = 255) a gap of 600 gets fillers 255 and 510 after its start.
    """
    pos = np.asarray(positions, np.int64)
    if pos.size == 0:
        return pos
    starts = np.concatenate([[0], pos[:-1]])
    gaps = pos - starts
    best, best_cost = pos, None
    for dt in INDEX_DTYPES:
        m = int(np.iinfo(dt).max)
        fill = np.maximum((gaps - 1) // m, 0)
        total = int(fill.sum())
        cost = (pos.size + total) * (np.dtype(dt).itemsize + value_bytes)
        if best_cost is None or cost < best_cost:
            if total:
                step = np.arange(total) - np.repeat(np.cumsum(fill) - fill, fill) + 1
                fillers = np.repeat(starts, fill) + step * m
                best = np.sort(np.concatenate([pos, fillers]))
            else:
                best = pos
            best_cost = cost
        if total == 0:
            break  # wider dtypes only cost more
    return best


def to_values(x: np.ndarray, value_dtype: str) -> np.ndarray:
    """Values as sent: float32, or float16 clipped to its finite range."""
    if value_dtype == "float16":
        return np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)
    return x.astype(np.float32)


# -- client side ---------------------------------------------------------------------------------
class SparseEncoder:
    """Client encoder of the `sparse` encoding, with error feedback.

    `encode(current, base)` sends, per weight tensor, p = (current - base) + residual at the
    selected entries (see `select` and `pad_gaps`) and remembers the leftover l (p minus what
    was sent, float16 rounding included); vectors are sent whole.

    Merging a global (`decode_global`) returns global + mix * l, and mix * l becomes the
    residual. The aggregator moves every entry it received to mix * mean + (1 - mix) *
    previous; the client moves the progress the aggregator did not receive the same way, so
    the whole model moves like in a dense round (where every entry is mixed) instead of only
    the sent entries being pulled back; measured on the demo configuration, this is what keeps
    sparse updates as accurate as dense ones. Since the client's `base` is that same sum,
    (current - base) + residual is always the client's delta to the true global, so the
    aggregator's base + delta is the client's actual value. Between two sends without a merge
    nothing changes, so nothing is counted twice.
    """

    name = "sparse"

    def __init__(self, topk: float = 0.1, threshold: float = 0.0,
                 value_dtype: str = "float32", mix: float = 0.5) -> None:
        self.residual: Tensors = {}
        self.pending: Tensors = {}
        self._set(topk, threshold, value_dtype, mix)

    def _set(self, topk: float, threshold: float, value_dtype: str, mix: float) -> None:
        if not 0 <= topk <= 1 or threshold < 0 or (topk == 0 and threshold == 0):
            raise ValueError("sparse encoding needs 0 < topk <= 1, or topk 0 and threshold > 0")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}")
        if not 0 <= mix <= 1:
            raise ValueError("mix must be in [0, 1]")
        self.topk, self.threshold, self.value_dtype, self.mix = topk, threshold, value_dtype, mix

    def configure(self, fed: FedConfig) -> None:
        """Take topk, threshold, value dtype and the aggregator's mix from the config."""
        self._set(fed.topk, fed.threshold, fed.value_dtype, fed.mix)

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        out: Tensors = {}
        pending: Tensors = {}
        for k, cur in current.items():
            if cur.ndim < 2:
                out[k] = np.asarray(cur, np.float32)
                continue
            p = np.asarray(cur, np.float32).ravel() - np.asarray(base[k], np.float32).ravel()
            r = self.residual.get(k)
            if r is not None:
                p = p + r
            idx = pad_gaps(select(p, self.topk, self.threshold),
                           np.dtype(VALUE_DTYPES[self.value_dtype]).itemsize)
            vals = to_values(p[idx], self.value_dtype)
            p[idx] -= vals.astype(np.float32)  # what was not sent, rounding included
            pending[k] = p
            out[k + IDX] = encode_indices(idx)
            out[k + VAL] = vals
        self.pending = pending
        return out

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        """The global plus mix * the leftover of the last send (a merge happened)."""
        if not self.pending:
            return tensors
        self.residual = {k: self.mix * v for k, v in self.pending.items()}
        self.pending = {}
        return {k: (v + self.residual[k].reshape(v.shape)).astype(np.float32)
                if k in self.residual else v for k, v in tensors.items()}


# -- payload parsing (aggregator side) -------------------------------------------------------
@dataclass
class Payload:
    """A validated update payload: absolute or delta values per entry, dense tensors, and
    knowledge-base contributions (APC)."""

    entries: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    kb: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def group_wire(tensors: Tensors) -> dict[str, dict[str, np.ndarray]]:
    """Wire tensors grouped by tensor name: {"dense": t} or {"idx"|"rows": .., "val": ..}."""
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        name, sep, suffix = key.rpartition("::")
        part = SUFFIXES.get("::" + suffix) if sep else None
        if part is None:
            name, part = key, "dense"
        groups.setdefault(name, {})[part] = t
    return groups


def _values(v: np.ndarray, count: int) -> np.ndarray:
    if v.dtype not in (np.float32, np.float16):
        raise SparseError("dtype", f"values must be float32 or float16, got {v.dtype}")
    if v.ndim != 1:
        raise SparseError("shape", f"values must be 1-D, got shape {v.shape}")
    if v.size != count:
        raise SparseError("length", f"{v.size} values for {count} entries")
    if not np.isfinite(v).all():
        raise SparseError("nonfinite", "NaN or Inf values")
    return v.astype(np.float64)


def decode_group(parts: dict[str, np.ndarray], shape: tuple[int, ...],
                 forms: frozenset[str]) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """One tensor's wire parts -> (positions, float64 values), or the dense array.

    `forms` lists what is accepted: "dense", "idx", "rows". Raises SparseError.
    """
    keys = frozenset(parts)
    if keys == {"dense"} and "dense" in forms:
        t = parts["dense"]
        if tuple(t.shape) != tuple(shape):
            raise SparseError("shape", f"shape {t.shape}, expected {shape}")
        if t.dtype != np.float32:
            raise SparseError("dtype", f"dense tensors must be float32, got {t.dtype}")
        if not np.isfinite(t).all():
            raise SparseError("nonfinite", "NaN or Inf values")
        return t
    n = math.prod(shape)
    if keys == {"idx", "val"} and "idx" in forms:
        pos = decode_indices(parts["idx"], n)
        return pos, _values(parts["val"], pos.size)
    if keys == {"rows", "val"} and "rows" in forms and len(shape) >= 1:
        rows = decode_indices(parts["rows"], shape[0])
        row_len = math.prod(shape[1:])
        vals = _values(parts["val"], rows.size * row_len)
        pos = (rows[:, None] * row_len + np.arange(row_len)[None, :]).ravel()
        return pos, vals
    raise SparseError("names", f"parts {sorted(keys)} are not a valid form of {sorted(forms)}")


KB = "::kb"
"""Suffix of APC knowledge-base tensors: `w::kb` (one task-adaptive tensor for layer `w`)."""


def decode_payload(tensors: Tensors, spec: Spec, forms: frozenset[str],
                   kb: bool = False) -> Payload:
    """Validate and decode a whole payload against the global spec.

    Every spec tensor must be present exactly once (in one of `forms`); with `kb`, optional
    `w::kb` pairs (`idx` form) are accepted for tensors `w` of the spec with 2 or more axes.
    Raises SparseError(reason).
    """
    groups = group_wire(tensors)
    missing = [k for k in spec if k not in groups]
    if missing:
        raise SparseError("names", f"missing tensors {missing[:5]}")
    out = Payload()
    for name, parts in groups.items():
        if name in spec:
            got = decode_group(parts, spec[name], forms)
            if isinstance(got, tuple):
                out.entries[name] = got
            else:
                out.dense[name] = got
        elif kb and name.endswith(KB) and len(spec.get(name[: -len(KB)], ())) >= 2:
            got = decode_group(parts, spec[name[: -len(KB)]], frozenset({"idx"}))
            out.kb[name[: -len(KB)]] = got  # type: ignore[assignment]
        else:
            raise SparseError("names", f"unexpected tensor {name!r}")
    return out


# -- aggregation ---------------------------------------------------------------------------------
class EntrySums:
    """Per-entry running sums of weight * value and of weight, float64; memory is two arrays
    per tensor whatever the number of clients."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}

    def add(self, name: str, size: int, pos: np.ndarray | None, values: np.ndarray,
            weight: float) -> None:
        """Add `values` at flat positions `pos` (None: every entry) with `weight`."""
        if name not in self.sums:
            self.sums[name] = np.zeros(size, np.float64)
            self.weights[name] = np.zeros(size, np.float64)
        where = slice(None) if pos is None else pos
        self.sums[name][where] += weight * np.asarray(values, np.float64).ravel()
        self.weights[name][where] += weight

    def result(self, previous: Tensors, mix_weight: float) -> Tensors:
        """Previous global with every entry someone sent replaced by
        mix * (weighted mean) + (1 - mix) * previous (float32)."""
        out: Tensors = {}
        for k, prev in previous.items():
            if k not in self.sums:
                out[k] = prev
                continue
            w = self.weights[k]
            sent = w > 0
            flat = np.asarray(prev, np.float32).ravel().copy()
            mean = self.sums[k][sent] / w[sent]
            flat[sent] = mix_weight * mean + (1.0 - mix_weight) * flat[sent].astype(np.float64)
            out[k] = flat.reshape(prev.shape)
        return out


def entries(payload: Payload, base: Tensors | None) -> Iterator[tuple[str, np.ndarray,
                                                                     np.ndarray]]:
    """(name, positions, absolute values) of a payload: `base` + delta, or the values as they
    are when `base` is None (absolute encodings)."""
    for name, (pos, vals) in payload.entries.items():
        if base is not None:
            vals = np.asarray(base[name], np.float64).ravel()[pos] + vals
        yield name, pos, vals


class SparseFedAvg(Strategy):
    """FedAvg of sparse deltas, per entry, weighted by samples.

    Each delta is relative to the global the client merged (`base_version`). The aggregator
    keeps the last `max_staleness + 1` globals (`Aggregator.history`), so the delta is turned
    back into the client's absolute value, base + delta, and every entry is averaged over the
    clients that sent it, then mixed with the previous global. This reproduces dense FedAvg
    exactly when every entry is sent (topk 1), also for clients that missed rounds. A delta
    whose base is no longer held is applied to the current global instead (rebased, counted as
    `sparse_rebased`); memory stays bounded by the history length.
    """

    encoding = "sparse"
    forms = frozenset({"idx", "dense"})

    def __init__(self, mix_weight: float = 0.5) -> None:
        super().__init__(mix_weight)
        self.acc = EntrySums()
        self.agg: Aggregator | None = None
        self.counters: Counter[str] = Counter()

    def bind(self, agg: Aggregator) -> None:
        """Give the strategy the aggregator (its global history and current version)."""
        self.agg = agg

    def check(self, update: Update, spec: Spec) -> str | None:
        if self.agg is not None and update.base_version > self.agg.global_.version:
            return "base"
        try:
            decode_payload(update.tensors, spec, self.forms)
        except SparseError as e:
            return e.reason
        return None

    def _base(self, version: int) -> Tensors:
        if self.agg is None:
            raise RuntimeError("SparseFedAvg needs bind(aggregator) before add()")
        base = self.agg.history.get(version)
        if base is None:
            self.counters["sparse_rebased"] += 1
            base = self.agg.global_.tensors
        return base

    def add(self, update: Update) -> None:
        base = self._base(update.base_version)
        spec = {k: v.shape for k, v in base.items()}
        payload = decode_payload(update.tensors, spec, self.forms)
        w = float(max(update.num_samples, 1))
        for name, pos, vals in entries(payload, base):
            self.acc.add(name, base[name].size, pos, vals, w)
        for name, t in payload.dense.items():
            self.acc.add(name, t.size, None, t, w)

    def result(self, previous: Tensors) -> Tensors:
        if not self.acc.sums:
            raise ValueError("no contributions to average")
        return self.acc.result(previous, self.mix_weight)


STRATEGIES[("sparse", "fedavg")] = SparseFedAvg
ENCODERS["sparse"] = SparseEncoder
