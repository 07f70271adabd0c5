"""Sparse parameter updates (docs/algorithms.md §2): top-k / threshold selection of the delta
to the base global with error feedback, compact indices and 16-bit values, validation, and per-entry
aggregation.

Wire format of one sparse tensor `w` (any float tensor of the global spec): one index part and
one value part.
- index: `w::<format>`, the positions in the flattened tensor in one of the registered index
  formats (`edgefcl.federation.indexing`: `idx` delta-coded gaps, `bits` packed bitmap, `zidx`
  / `zbits` the same compressed with zlib); the encoder picks the cheapest per tensor;
- `w::rows`: delta-coded gaps of whole rows (first axis) instead of single entries (APC);
- values: `w::val` (float32 or float16) or `w::bf16` (bfloat16 as uint16 bits); one per index,
  or one row each for `::rows`.
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
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from edgefcl.federation.encodings import Encoding
from edgefcl.federation.folds import FOLDS
from edgefcl.federation.indexing import INDEX_FORMATS, decode_positions, encode_cheapest
from edgefcl.federation.indexing.gaps import (  # noqa: F401  (re-exported)
    INDEX_DTYPES,
    decode_indices,
    encode_indices,
    index_dtype,
    pad_gaps,
)
from edgefcl.federation.indexing.index_format import SparseError
from edgefcl.federation.messages import Checked, Tensors, Update
from edgefcl.federation.strategy import (
    Spec,
    Strategy,
    check_tensor,
    sample_weight,
    scalar_factor,
    value_reason,
)
from edgefcl.federation.value_bound import MAX_VALUE

IDX, ROWS, VAL, BF16 = "::idx", "::rows", "::val", "::bf16"
VALUE_SUFFIXES = ("val", "bf16")
SUFFIXES = {"::" + s: s for s in (*INDEX_FORMATS, "rows", *VALUE_SUFFIXES)}
VALUE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
"""Value dtypes a client may send; bfloat16 travels as its raw 16 bits (`w::bf16`, uint16)."""
F16_MAX = float(np.finfo(np.float16).max)
BF16_MAX_BITS = 0x7F7F
"""Largest finite bfloat16 magnitude, as bits."""


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


def resolve_value_dtype(value_dtype: str, topk: float) -> str:
    """`auto` -> float16 when only a fraction of the entries is sent (topk < 1), float32 when
    every entry is (topk 1 reproduces dense FedAvg exactly); other names stay."""
    if value_dtype != "auto":
        return value_dtype
    return "float16" if 0 < topk < 1 else "float32"


def to_values(x: np.ndarray, value_dtype: str) -> np.ndarray:
    """Values as sent under `w::val`: float16 clipped to its finite range, else float32
    (`auto` included: APC sends float32 unless told float16)."""
    if value_dtype == "float16":
        return np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)
    return x.astype(np.float32)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bits (uint16), rounded to nearest even, clipped to the finite
    range (inputs must be finite)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    mag, sign = rounded & 0x7FFF, rounded & 0x8000
    return np.where(mag > BF16_MAX_BITS, sign | BF16_MAX_BITS, rounded).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def value_part(x: np.ndarray, value_dtype: str) -> tuple[str, np.ndarray, np.ndarray]:
    """(wire suffix, wire array, the float32 values the receiver will read) for float32 `x`."""
    if value_dtype == "bfloat16":
        bits = to_bfloat16(x)
        return "bf16", bits, from_bfloat16(bits)
    vals = to_values(x, value_dtype)
    return "val", vals, vals.astype(np.float32)


# -- client side ---------------------------------------------------------------------------------
class SparseEncoder:
    """Client encoder of the `sparse` encoding, with error feedback.

    `encode(current, base)` sends, per weight tensor, p = (current - base) + residual at the
    selected entries (see `select`), with the index in the cheapest registered format
    (`edgefcl.federation.indexing`; `index_format` restricts the choice to one) and the values
    in `value_dtype`, and remembers the leftover l (p minus what the receiver will read:
    float16 / bfloat16 rounding included); vectors are sent whole.

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
                 value_dtype: str = "auto", mix: float = 0.5,
                 index_format: str = "auto") -> None:
        self.residual: Tensors = {}
        self.pending: Tensors = {}
        self._set(topk, threshold, value_dtype, mix, index_format)

    def _set(self, topk: float, threshold: float, value_dtype: str, mix: float,
             index_format: str = "auto") -> None:
        if not 0 <= topk <= 1 or threshold < 0 or (topk == 0 and threshold == 0):
            raise ValueError("sparse encoding needs 0 < topk <= 1, or topk 0 and threshold > 0")
        value_dtype = resolve_value_dtype(value_dtype, topk)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be auto or one of {sorted(VALUE_DTYPES)}")
        if not 0 <= mix <= 1:
            raise ValueError("mix must be in [0, 1]")
        if index_format != "auto" and index_format not in INDEX_FORMATS:
            raise ValueError(f"index_format must be auto or one of {sorted(INDEX_FORMATS)}")
        self.topk, self.threshold, self.value_dtype, self.mix = topk, threshold, value_dtype, mix
        self.allowed = None if index_format == "auto" else (index_format,)

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        out: Tensors = {}
        pending: Tensors = {}
        value_bytes = np.dtype(VALUE_DTYPES[self.value_dtype]).itemsize
        for k, cur in current.items():
            if cur.ndim < 2:
                out[k] = np.asarray(cur, np.float32)
                continue
            p = np.asarray(cur, np.float32).ravel() - np.asarray(base[k], np.float32).ravel()
            r = self.residual.get(k)
            if r is not None:
                p = p + r
            fmt, index, pos = encode_cheapest(select(p, self.topk, self.threshold), p.size,
                                              value_bytes, self.allowed)
            vsuffix, vals, received = value_part(p[pos], self.value_dtype)
            p[pos] -= received  # what was not sent, rounding included
            pending[k] = p
            out[f"{k}::{fmt}"] = index
            out[f"{k}::{vsuffix}"] = vals
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


def _changes(tensors: Tensors, reference: Tensors
             ) -> Iterator[tuple[str, str | None, np.ndarray]]:
    """(wire key, value suffix or None for a whole tensor, float32 change) of every part of a
    sparse payload that carries a change: its entries' values (changes on the sender's base)
    and its whole float tensors' difference to `reference`."""
    for key, t in tensors.items():
        _, sep, suffix = key.rpartition("::")
        if not sep:
            ref = reference.get(key)
            if ref is not None and t.dtype.kind == "f" and t.shape == ref.shape:
                yield key, None, (t - ref).ravel()
        elif suffix == "bf16":
            yield key, suffix, from_bfloat16(t)
        elif suffix == "val":
            yield key, suffix, t.astype(np.float32, copy=False)


def change_norm(tensors: Tensors, reference: Tensors) -> float:
    """L2 norm of the change a checked sparse payload carries (`_changes`): what norm
    clipping bounds (`robust/clipping.py`), read without decoding an index."""
    return math.sqrt(sum(float(np.dot(d, d)) for _, _, d in _changes(tensors, reference)))


def scaled_change(tensors: Tensors, scale: float, reference: Tensors) -> Tensors:
    """A checked sparse payload with its change scaled by `scale` <= 1: entry values times
    `scale` in their wire dtype, whole tensors at `reference` + scale x their difference."""
    out = dict(tensors)
    for key, suffix, d in _changes(tensors, reference):
        if suffix is None:
            out[key] = (reference[key] + scale * d).astype(tensors[key].dtype)
        elif suffix == "bf16":
            out[key] = to_bfloat16((scale * d).astype(np.float32))
        else:
            out[key] = (scale * d).astype(tensors[key].dtype)
    return out


ENTRY_FORMS = frozenset({"dense", "rows", *INDEX_FORMATS})
"""Every form a payload of absolute entries may carry a tensor in."""


def _entry_changes(tensors: Tensors, reference: Tensors
                   ) -> Iterator[tuple[str, str | None, np.ndarray, np.ndarray]]:
    """(wire key, value suffix or None for a whole tensor, float64 change, reference values
    there) of every part of a checked payload of absolute entries (apc: rows or positions of
    a tensor with float or bfloat16 values, and whole tensors) that changes a tensor of
    `reference`; knowledge-base pairs change none."""
    for name, parts in group_wire(tensors).items():
        ref = reference.get(name)
        if name.endswith(KB) or ref is None:
            continue
        flat = np.asarray(ref, np.float64).ravel()
        got = decode_group(parts, tuple(ref.shape), ENTRY_FORMS)
        if not isinstance(got, tuple):
            yield name, None, got.astype(np.float64).ravel() - flat, flat
            continue
        pos, vals = got
        suffix = next(s for s in VALUE_SUFFIXES if s in parts)
        yield f"{name}::{suffix}", suffix, vals - flat[pos], flat[pos]


def entries_change_norm(tensors: Tensors, reference: Tensors) -> float:
    """L2 norm of the change a checked payload of absolute entries makes to `reference`
    (`_entry_changes`): what norm clipping bounds for apc (`robust/clipping.py`)."""
    return math.sqrt(sum(float(np.dot(d, d)) for _, _, d, _ in _entry_changes(tensors,
                                                                               reference)))


def scaled_entries_change(tensors: Tensors, scale: float, reference: Tensors) -> Tensors:
    """A checked payload of absolute entries with its change on `reference` scaled by
    `scale` <= 1, in the wire dtypes (indices and knowledge-base pairs as they are)."""
    out = dict(tensors)
    for key, suffix, d, ref in _entry_changes(tensors, reference):
        t = tensors[key]
        new = (ref + scale * d).astype(np.float32)
        out[key] = (to_bfloat16(new) if suffix == "bf16" else new.astype(t.dtype)).reshape(
            t.shape)
    return out


def _values(v: np.ndarray, count: int, suffix: str = "val") -> np.ndarray:
    if suffix == "bf16":
        if v.dtype != np.uint16:
            raise SparseError("dtype", f"bfloat16 values travel as uint16 bits, got {v.dtype}")
    elif v.dtype not in (np.float32, np.float16):
        raise SparseError("dtype", f"values must be float32 or float16, got {v.dtype}")
    if v.ndim != 1:
        raise SparseError("shape", f"values must be 1-D, got shape {v.shape}")
    if v.size != count:
        raise SparseError("length", f"{v.size} values for {count} entries")
    if suffix == "bf16":
        v = from_bfloat16(v)
    reason = value_reason(v)
    if reason == "nonfinite":
        raise SparseError(reason, "NaN or Inf values")
    if reason is not None:
        raise SparseError(reason, f"values beyond {MAX_VALUE:g} in magnitude")
    return v.astype(np.float64)


def decode_group(parts: dict[str, np.ndarray], shape: tuple[int, ...],
                 forms: frozenset[str]) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """One tensor's wire parts -> (positions, float64 values), or the dense array.

    `forms` lists what is accepted: "dense", "rows" and index formats ("idx", "bits", ...).
    Raises SparseError.
    """
    keys = frozenset(parts)
    if keys == {"dense"} and "dense" in forms:
        t = parts["dense"]
        reason = check_tensor(t, shape)
        if reason is not None:
            raise SparseError(reason, f"dense part: {reason} (shape {t.shape}, expected "
                              f"{shape}, dtype {t.dtype}, float32 and finite)")
        return t
    n = math.prod(shape)
    vkeys = keys & set(VALUE_SUFFIXES)
    index = keys - vkeys
    if len(vkeys) == 1 and len(index) == 1:
        (vkey,), (ikey,) = vkeys, index
        if ikey in INDEX_FORMATS and ikey in forms:
            pos = decode_positions(ikey, parts[ikey], n, parts[vkey].size)
            return pos, _values(parts[vkey], pos.size, vkey)
        if ikey == "rows" and "rows" in forms and len(shape) >= 1:
            rows = decode_indices(parts["rows"], shape[0])
            row_len = math.prod(shape[1:])
            vals = _values(parts[vkey], rows.size * row_len, vkey)
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

    def means(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(weighted mean per entry, flat; which entries someone sent), for `mix`."""
        if not self.sums:
            raise ValueError("no contributions to average")
        new, sent = {}, {}
        for k, w in self.weights.items():
            sent[k] = w > 0
            new[k] = np.divide(self.sums[k], w, out=np.zeros_like(w), where=sent[k])
        return new, sent


def entries(payload: Payload, base: Tensors | None) -> Iterator[tuple[str, np.ndarray,
                                                                     np.ndarray]]:
    """(name, positions, absolute values) of a payload: `base` + delta, or the values as they
    are when `base` is None (absolute encodings)."""
    for name, (pos, vals) in payload.entries.items():
        if base is not None:
            vals = np.asarray(base[name]).ravel()[pos].astype(np.float64) + vals
        yield name, pos, vals


class SparseFedAvg(Strategy):
    """FedAvg of sparse deltas, per entry, weighted by samples.

    Each delta is relative to the global the client merged (`base_version`). The aggregator
    keeps the last `max_staleness + 1` globals (`RoundInput.bases`), so the delta is turned
    back into the client's absolute value, base + delta, and every entry is averaged over the
    clients that sent it, then mixed with the previous global. This reproduces dense FedAvg
    exactly when every entry is sent (topk 1), also for clients that missed rounds. A delta
    whose base is no longer held is applied to the current global instead (rebased, counted as
    `sparse_rebased`); memory stays bounded by the history length.
    """

    forms = frozenset({*INDEX_FORMATS, "dense"})
    decomposable = True

    def reset(self) -> None:
        self.acc = EntrySums()
        self.weight = 0.0  # the updates' sample weight, whatever entries each sent

    def _base(self, version: int) -> Tensors:
        if FOLDS[self.fed.fold].onto_current:
            return self.round.previous  # the delta fold: every delta onto the current global
        base = self.round.bases(version)
        if base is None:
            self.counts["sparse_rebased"] += 1
            base = self.round.previous
        return base

    def add(self, update: Update) -> None:
        base = self._base(update.base_version)
        spec = {k: v.shape for k, v in base.items()}
        checked = update.checked.for_(update.tensors, spec) if update.checked else None
        payload = checked if isinstance(checked, Payload) else decode_payload(
            update.tensors, spec, self.forms)
        w = sample_weight(update)
        self.weight += w
        for name, pos, vals in entries(payload, base):
            self.acc.add(name, base[name].size, pos, vals, w)
        for name, t in payload.dense.items():
            self.acc.add(name, t.size, None, t, w)

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray],
                                                   dict[str, np.ndarray]]:
        return self.acc.means()

    def partial(self) -> dict:
        """Per tensor, the flat per-entry sums of weight * absolute value and of weight (the
        deltas were already turned into absolute values against their base)."""
        return {"sums": dict(self.acc.sums), "weights": dict(self.acc.weights),
                "weight": self.weight, **self.fresh_partial()}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`, entry by entry."""
        for k in sorted(partial["sums"]):
            s = np.asarray(partial["sums"][k], np.float64).ravel()
            if k not in self.acc.sums:
                self.acc.sums[k], self.acc.weights[k] = np.zeros_like(s), np.zeros_like(s)
            self.acc.sums[k] += s
            self.acc.weights[k] += np.asarray(partial["weights"][k], np.float64).ravel()
        self.weight += float(partial.get("weight", 0.0))
        self.merge_fresh(partial)

    def partial_weights(self, partial: dict) -> dict[str, np.ndarray]:
        """Its updates' whole sample weight (a single aggregator caps an update's, not its
        entries': an entry one device alone sent would have been capped to nothing)."""
        return {"weight": np.array([float(partial.get("weight", 0.0))])}

    def scale_partial(self, partial: dict, factors: dict[str, np.ndarray]) -> dict:
        f = scalar_factor(factors, "weight")
        return {**partial, "weight": float(partial.get("weight", 0.0)) * f,
                "sums": {k: np.asarray(v, np.float64) * f for k, v in partial["sums"].items()},
                "weights": {k: np.asarray(v, np.float64) * f
                            for k, v in partial["weights"].items()}}


def payload_reason(tensors: Tensors, spec: Spec, forms: frozenset[str],
                   kb: bool = False) -> str | None:
    """Reason to reject a payload `decode_payload` reads (sparse, apc), or None."""
    try:
        decode_payload(tensors, spec, forms, kb)
    except SparseError as e:
        return e.reason
    return None


def check_sparse(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject a sparse payload, or None."""
    return payload_reason(tensors, spec, SparseFedAvg.forms)


def checked_sparse(tensors: Tensors, spec: Spec) -> tuple[str | None, Checked | None]:
    """`check_sparse`, keeping the decoded payload for `SparseFedAvg.add`: positions as int32
    (int64 past 2**31 entries) and values as float32, which hold every value the wire can
    carry exactly (float16, bfloat16, float32), so that the fold reads the same numbers."""
    try:
        payload = decode_payload(tensors, spec, SparseFedAvg.forms)
    except SparseError as e:
        return e.reason, None
    compact, extra = {}, 0
    for name, (pos, vals) in payload.entries.items():
        pos = pos.astype(np.int32) if math.prod(spec[name]) < 2**31 else pos
        vals = vals.astype(np.float32)
        compact[name] = (pos, vals)
        extra += pos.nbytes + vals.nbytes
    payload.entries = compact
    return None, Checked(tensors, dict(spec), payload, extra)


SPARSE = Encoding(
    name="sparse",
    help="top-k of the delta to the last global, error feedback",
    make_encoder=lambda fed: SparseEncoder(fed.topk, fed.threshold, fed.value_dtype, fed.mix,
                                           fed.index_format),
    validate=check_sparse,
    check=checked_sparse,
    rules={"fedavg": SparseFedAvg},
    form="sparse",
    downlink="sparse",
    exportable=True,
)
