"""Global model versions: a bounded history on the aggregator, sparse downlink deltas, and
which downlink a fleet uses.

A client that holds global version v can receive version v' as a delta: only the tensors that
changed, each either whole (when that is smaller) or as an index (`w::idx`, `w::bits`, ... the
cheapest registered format) and `w::val` holding the NEW values of the changed entries (not
differences), so applying a delta is bit-exact. The payload
carries `::delta_from` (int64 scalar) = v. Tensor names are never removed between versions; a
version that drops a name is sent whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.indexing import INDEX_FORMATS, decode_positions, encode_cheapest
from edgefcl.federation.messages import GlobalModel, Tensors
from edgefcl.federation.registry import get_encoding
from edgefcl.federation.sparse import VAL, SparseError

DELTA_FROM = "::delta_from"
PAIR_OVERHEAD = 32
"""msgpack bytes a second tensor map costs (name, dtype, shape, data headers)."""


class GlobalHistory:
    """The last `size` global versions (version -> tensors), oldest dropped first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("history size must be >= 1")
        self.size = size
        self._versions: OrderedDict[int, Tensors] = OrderedDict()

    def push(self, version: int, tensors: Tensors) -> None:
        self._versions[version] = tensors
        self._versions.move_to_end(version)
        while len(self._versions) > self.size:
            self._versions.popitem(last=False)

    def drop_after(self, version: int) -> None:
        """Forget the versions newer than `version`."""
        for v in [v for v in self._versions if v > version]:
            del self._versions[v]

    def get(self, version: int) -> Tensors | None:
        return self._versions.get(version)

    def versions(self) -> list[int]:
        return list(self._versions)

    def clear(self) -> None:
        self._versions.clear()


def _bits(t: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(t).ravel()
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def global_delta(new: Tensors, old: Tensors, old_version: int) -> Tensors | None:
    """Payload tensors that turn `old` (held by the client) into `new`; None when the whole
    global must be sent instead (a tensor name disappeared)."""
    if any(k not in new for k in old):
        return None
    out: Tensors = {}
    for k, t in new.items():
        o = old.get(k)
        if o is None or o.shape != t.shape or o.dtype != t.dtype:
            out[k] = t
            continue
        changed = np.flatnonzero(_bits(t) != _bits(o))
        if changed.size == 0:
            continue
        # the cheapest index format; fillers (`idx`) carry their unchanged values
        fmt, index, covered = encode_cheapest(changed, t.size, t.dtype.itemsize)
        if index.nbytes + covered.size * t.dtype.itemsize + PAIR_OVERHEAD >= t.nbytes:
            out[k] = t
        else:
            out[f"{k}::{fmt}"] = index
            out[k + VAL] = np.ascontiguousarray(t).ravel()[covered]
    out[DELTA_FROM] = np.array(old_version, np.int64)
    return out


def apply_global_delta(delta: Tensors, held: Tensors) -> Tensors:
    """The full global from a delta payload and the tensors held; raises SparseError."""
    out = dict(held)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for k, t in delta.items():
        if k == DELTA_FROM:
            continue
        name, sep, part = k.rpartition("::")
        if sep and (part in INDEX_FORMATS or part == "val"):
            pairs.setdefault(name, {})[part] = t
        else:
            out[k] = t
    for name, p in pairs.items():
        index = set(p) - {"val"}
        if name not in held or len(p) != 2 or "val" not in p:
            raise SparseError("names", f"delta for {name!r} does not match the held global")
        arr = np.array(held[name], copy=True)
        (fmt,) = index
        pos = decode_positions(fmt, p[fmt], arr.size, p["val"].size)
        if p["val"].dtype != arr.dtype or p["val"].shape != pos.shape:
            raise SparseError("length", f"delta values for {name!r} do not match its indices")
        arr.reshape(-1)[pos] = p["val"]
        out[name] = arr
    return out


def delta_downlink(fed: FedConfig) -> bool:
    """Whether globals go to clients as deltas (downlink sparse, or auto with sparse globals,
    `global_topk`, or with an encoding whose descriptor says sparse: sparse, apc)."""
    return fed.downlink == "sparse" or (fed.downlink == "auto" and (
        fed.global_topk > 0 or get_encoding(fed.encoding).downlink == "sparse"))


PULL_FLEET = 100
"""Clients (`fed.clients`) from which `--downlink auto` has an async fleet pull its whole
globals (`pull_downlink`)."""


def pull_downlink(fed: FedConfig) -> bool:
    """Whether async devices listen for the whole global only while an update of theirs waits
    to be counted, instead of receiving every version (downlink pull, or auto for a fleet of
    PULL_FLEET clients or more without a delta downlink): each device then receives about one
    global per update it sends instead of one per round."""
    if fed.mode != "async" or delta_downlink(fed):
        return False
    return fed.downlink == "pull" or (fed.downlink == "auto" and fed.clients >= PULL_FLEET)


def downlink_message(g: GlobalModel, history: GlobalHistory, held_version: int) -> GlobalModel:
    """What a client holding `held_version` receives: the delta when that version is still in
    the history, else the whole global."""
    old = history.get(held_version)
    if old is None or held_version >= g.version:
        return g
    delta = global_delta(g.tensors, old, held_version)
    return g if delta is None else replace(g, tensors=delta)


class DownlinkState:
    """The client's copy of the last global it merged; turns delta messages into whole
    globals (dense messages pass through)."""

    def __init__(self, tensors: Tensors, version: int = 0) -> None:
        self.tensors = dict(tensors)
        self.version = version

    def resolve(self, g: GlobalModel) -> GlobalModel:
        if DELTA_FROM in g.tensors:
            frm = int(g.tensors[DELTA_FROM])
            if frm != self.version:
                raise ValueError(f"global v{g.version} is a delta from v{frm}, but this client "
                                 f"holds v{self.version}; the aggregator must send it whole")
            g = replace(g, tensors=apply_global_delta(g.tensors, self.tensors))
        self.tensors = dict(g.tensors)
        self.version = g.version
        return g
