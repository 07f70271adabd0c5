"""Wire codec: msgpack payloads for every message of the MQTT protocol.

Every payload is a msgpack map with at least `schema` (SCHEMA_VERSION), `kind`, `fleet` and
`sender`; the other keys depend on the kind. Tensors travel as maps
`{"dtype": "<f4", "shape": [..], "data": <raw little-endian bytes>}`; with `wire_dtype="<f2"`
float32 tensors are sent as float16 and carry `"to": "<f4"` so the receiver restores float32.

`decode` validates everything that comes in and raises `CodecError(reason)` with a short
machine-readable reason (schema, fleet, malformed, kind, dtype, shape, nonfinite, oversized,
digest) so daemons can log and count rejections instead of crashing.

Before anything is allocated, `transport.bounds.scan` checks the raw bytes against `Limits`
(nesting depth, object count, declared lengths; reason "limits").

`encode` seals every payload with a digest of its bytes (`edgefcl.transport.integrity`); `decode`
rejects a payload whose digest does not match (reason "digest"), and one without a digest when
called with `require_digest=True` (the aggregator daemon does).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from edgefcl.data.labels import MAX_LABELS
from edgefcl.data.types import Batch
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.transport import integrity
from edgefcl.transport.bounds import DEFAULT_LIMITS, Limits, scan
from edgefcl.transport.codec_error import CodecError
from edgefcl.transport.kinds import KINDS, MAP_KINDS, label_list
from edgefcl.transport.kinds import field as _get

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
"""Largest payload `decode` accepts (matches `max_packet_size` of broker/mosquitto.conf)."""

ALLOWED_DTYPES = frozenset(
    ["<f2", "<f4", "<f8", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8"]
)
FLOAT_DTYPES = frozenset(["<f2", "<f4", "<f8"])
WIRE_DTYPES = frozenset(["<f4", "<f2"])
MAX_NDIM = 32

RESERVED_KEYS = frozenset(["schema", "kind", "fleet", "sender", integrity.DIGEST_KEY])
_TENSOR_KEYS = frozenset(["dtype", "shape", "data"])

TensorSpec = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, dtype string such as '<f4'), in state_dict order."""


@dataclass
class Message:
    """A plain-dict message (config, status, control, stream, answer) with its envelope."""

    kind: str
    body: dict[str, Any]
    fleet: str = ""
    sender: str = ""


# ---------------------------------------------------------------- tensors


def _dtype_str(dt: np.dtype) -> str:
    le = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    return le.str


def encode_tensor(arr: np.ndarray, wire_dtype: str | None = None) -> dict[str, Any]:
    """One array as a tensor map; float32 arrays are cast to `wire_dtype` if given."""
    a = np.asarray(arr)
    dt = _dtype_str(a.dtype)
    if dt not in ALLOWED_DTYPES:
        raise CodecError("dtype", f"cannot send dtype {a.dtype}; allowed: {sorted(ALLOWED_DTYPES)}")
    out: dict[str, Any] = {}
    if wire_dtype is not None and wire_dtype != dt and dt == "<f4":
        if wire_dtype not in WIRE_DTYPES:
            raise CodecError("dtype", f"wire_dtype must be one of {sorted(WIRE_DTYPES)}")
        with np.errstate(over="ignore"):
            cast = a.astype(wire_dtype)
        if not np.isfinite(cast).all() and np.isfinite(a).all():
            raise CodecError(
                "range", f"values beyond ±{np.finfo(np.float16).max:g} overflow float16 on the "
                "wire; send float32 (wire_dtype=None)"
            )
        out["to"] = dt
        a, dt = cast, wire_dtype
    a = a.astype(dt, order="C", copy=False)  # little-endian, C order (0-d arrays stay 0-d)
    out.update(dtype=dt, shape=list(a.shape), data=memoryview(a.reshape(-1)).cast("B"))
    return out


def _is_tensor_map(v: Any) -> bool:
    if not isinstance(v, dict) or not v.keys() >= _TENSOR_KEYS:
        return False
    return len(v) == 3 or (len(v) == 4 and "to" in v)


def decode_tensor(m: Any, name: str = "") -> np.ndarray:
    """A tensor map back to a writable numpy array; raises CodecError on anything invalid."""
    if not isinstance(m, dict) or not _is_tensor_map(m):
        raise CodecError("malformed", f"tensor {name!r}: expected a map with dtype, shape, data")
    dt, shape, data = m["dtype"], m["shape"], m["data"]
    if not isinstance(dt, str) or dt not in ALLOWED_DTYPES:
        raise CodecError("dtype", f"tensor {name!r}: dtype {dt!r} not in {sorted(ALLOWED_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise CodecError("shape", f"tensor {name!r}: shape must be a list of non-negative ints")
    if not isinstance(data, bytes):
        raise CodecError("malformed", f"tensor {name!r}: data must be bytes")
    itemsize = np.dtype(dt).itemsize
    if len(data) != math.prod(shape) * itemsize:
        raise CodecError(
            "shape",
            f"tensor {name!r}: {len(data)} data bytes but shape {shape} x {itemsize} needs "
            f"{math.prod(shape) * itemsize}",
        )
    try:
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
    except (ValueError, OverflowError):  # e.g. a zero dimension next to a huge one
        raise CodecError("shape", f"tensor {name!r}: shape {shape} cannot be built") from None
    if dt in FLOAT_DTYPES and not np.isfinite(arr).all():
        raise CodecError("nonfinite", f"tensor {name!r}: NaN or Inf values")
    to = m.get("to")
    if to is not None:
        if not isinstance(to, str) or to not in FLOAT_DTYPES or dt not in FLOAT_DTYPES:
            raise CodecError("dtype", f"tensor {name!r}: cannot restore {dt!r} to {to!r}")
        return arr.astype(to)
    return arr.copy()


def _encode_tensors(tensors: Tensors, wire_dtype: str | None) -> dict[str, Any]:
    if not isinstance(tensors, dict):
        raise CodecError("malformed", "tensors must be a dict name -> array")
    return {str(k): encode_tensor(v, wire_dtype) for k, v in tensors.items()}


def _decode_tensors(m: Any, limits: Limits = DEFAULT_LIMITS) -> Tensors:
    if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
        raise CodecError("malformed", "tensors must be a map of name -> tensor")
    if len(m) > limits.max_tensors:
        raise CodecError("limits", f"{len(m)} tensors > limit {limits.max_tensors}")
    return {k: decode_tensor(v, k) for k, v in m.items()}


def _encode_prototypes(table: LabelRows | None, wire_dtype: str | None) -> Any:
    """A prototype library as {labels: [str], rows: tensor, counts: tensor} plus sigmas:
    tensor for a Gaussian library (None: absent)."""
    if table is None:
        return None
    out = {"labels": [str(n) for n in table.labels],
           "rows": encode_tensor(np.asarray(table.rows, np.float32), wire_dtype),
           "counts": encode_tensor(np.asarray(table.counts, np.int64))}
    if table.sigmas is not None:
        out["sigmas"] = encode_tensor(np.asarray(table.sigmas, np.float32), wire_dtype)
    return out


def _decode_prototypes(m: Any) -> LabelRows | None:
    """The library of a payload; bounds (label count and length) before the tensors, then
    the shapes (sigmas, when present: the rows' shape, float32, finite and > 0). Semantics
    (width, duplicates) are the aggregator's `check_rows`."""
    if m is None:
        return None
    if not isinstance(m, dict) or set(m) - {"sigmas"} != {"labels", "rows", "counts"}:
        raise CodecError("malformed", "prototypes must be a map of labels, rows, counts "
                         "(and sigmas)")
    labels = label_list(m["labels"], "prototype labels")
    rows = decode_tensor(m["rows"], "prototypes.rows")
    counts = decode_tensor(m["counts"], "prototypes.counts")
    if rows.ndim != 2 or rows.shape[0] != len(labels) or counts.shape != (len(labels),):
        raise CodecError("shape", f"prototype rows {rows.shape} / counts {counts.shape} do not "
                         f"match {len(labels)} labels")
    if rows.dtype != np.float32 or counts.dtype.kind not in "iu":
        raise CodecError("dtype", "prototype rows must be float32 and counts integers")
    sigmas = None
    if "sigmas" in m:
        sigmas = decode_tensor(m["sigmas"], "prototypes.sigmas")
        if sigmas.shape != rows.shape:
            raise CodecError("shape", f"prototype sigmas {sigmas.shape} do not match the rows "
                             f"{rows.shape}")
        if sigmas.dtype != np.float32:
            raise CodecError("dtype", "prototype sigmas must be float32")
        if not (sigmas > 0).all():  # decode_tensor rejected NaN and Inf
            raise CodecError("sigma", "prototype sigmas must be > 0")
    return LabelRows(tuple(labels), rows, counts.astype(np.int64), sigmas)


# ---------------------------------------------------------------- model spec


def tensor_spec(tensors: Tensors) -> TensorSpec:
    """Shapes and dtypes of a set of tensors, in their order."""
    return {k: (tuple(int(d) for d in v.shape), _dtype_str(v.dtype)) for k, v in tensors.items()}


def spec_hash(spec: TensorSpec) -> str:
    """Short (16 hex chars) sha256 of a TensorSpec, independent of the tensor order."""
    canon = json.dumps(sorted((k, list(s), d) for k, (s, d) in spec.items()), separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def check_tensors(tensors: Tensors, spec: TensorSpec) -> None:
    """Raise CodecError("names" | "shape" | "dtype") unless `tensors` matches `spec` exactly."""
    missing = [k for k in spec if k not in tensors]
    extra = [k for k in tensors if k not in spec]
    if missing or extra:
        raise CodecError("names", f"missing tensors {missing[:5]}, unexpected {extra[:5]}")
    for k, (shape, dt) in spec.items():
        t = tensors[k]
        if tuple(t.shape) != tuple(shape):
            raise CodecError("shape", f"tensor {k!r} has shape {tuple(t.shape)}, expected {shape}")
        if _dtype_str(t.dtype) != dt:
            raise CodecError("dtype", f"tensor {k!r} has dtype {t.dtype.str}, expected {dt}")


# ---------------------------------------------------------------- encode


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return encode_tensor(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


def _pack(obj: dict[str, Any]) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True, default=_default)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, CodecError):
            raise
        raise CodecError("malformed", f"cannot encode message: {e}") from e


def _envelope(kind: str, fleet: str, sender: str) -> dict[str, Any]:
    if not isinstance(fleet, str) or not fleet:
        raise CodecError("fleet", "fleet must be a non-empty string")
    if not isinstance(sender, str) or not sender:
        raise CodecError("malformed", "sender must be a non-empty string")
    return {"schema": SCHEMA_VERSION, "kind": kind, "fleet": fleet, "sender": sender}


def encode(
    msg: Update | Tick | GlobalModel | Message,
    *,
    fleet: str,
    sender: str | None = None,
    wire_dtype: str | None = None,
) -> bytes:
    """Encode a message as msgpack bytes.

    `sender` defaults to the update/tick client, "aggregator" for a GlobalModel, and
    `msg.sender` for a Message. `wire_dtype="<f2"` sends float32 tensors as float16.
    """
    return integrity.seal(to_map(msg, fleet=fleet, sender=sender, wire_dtype=wire_dtype), _pack)


def to_map(
    msg: Update | Tick | GlobalModel | Message,
    *,
    fleet: str,
    sender: str | None = None,
    wire_dtype: str | None = None,
) -> dict[str, Any]:
    """The map `encode` packs and seals (the load generator's update template starts from
    it, so the update layout is written once)."""
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise CodecError("dtype", f"wire_dtype must be None or one of {sorted(WIRE_DTYPES)}")
    if isinstance(msg, Update):
        m = _envelope("update", fleet, sender or msg.client)
        m.update(
            client=msg.client, base_version=int(msg.base_version), seq=int(msg.seq),
            task=int(msg.task), batch=int(msg.batch), num_samples=int(msg.num_samples),
            encoding=msg.encoding, tensors=_encode_tensors(msg.tensors, wire_dtype),
            class_counts=None if msg.class_counts is None
            else {int(k): int(v) for k, v in msg.class_counts.items()},
        )
        if msg.prototypes is not None:
            m["prototypes"] = _encode_prototypes(msg.prototypes, wire_dtype)
    elif isinstance(msg, Tick):
        m = _envelope("tick", fleet, sender or msg.client)
        m.update(client=msg.client, seq=int(msg.seq), task=int(msg.task), batch=int(msg.batch))
    elif isinstance(msg, GlobalModel):
        m = _envelope("global", fleet, sender or "aggregator")
        m.update(
            version=int(msg.version), tensors=_encode_tensors(msg.tensors, wire_dtype),
            participants=[str(p) for p in msg.participants],
        )
        if msg.counted:
            m["counted"] = {str(c): int(s) for c, s in msg.counted.items()}
        if msg.run is not None:
            m["run"] = str(msg.run)
        if msg.prototypes is not None:
            m["prototypes"] = _encode_prototypes(msg.prototypes, wire_dtype)
    elif isinstance(msg, Message):
        if msg.kind not in MAP_KINDS:
            raise CodecError("kind", f"unknown kind {msg.kind!r}; known {sorted(MAP_KINDS)}")
        clash = RESERVED_KEYS & msg.body.keys()
        if clash:
            raise CodecError("malformed", f"body keys {sorted(clash)} are reserved")
        m = _envelope(msg.kind, fleet, sender or msg.sender)
        for k, v in msg.body.items():
            m[str(k)] = encode_tensor(v, wire_dtype) if isinstance(v, np.ndarray) else v
    else:
        raise CodecError("kind", f"cannot encode {type(msg).__name__}")
    return m


def encode_batch(
    batch: Batch, *, client: str, fleet: str, sender: str = "replayer",
    wire_dtype: str | None = None,
) -> bytes:
    """A stream mini-batch for `client` (kind "stream"). Labels that are names (a unicode
    array: prototype-head runs) travel as `names`, the batch's distinct names sorted, and
    `y`, each sample's position among them (uint16)."""
    body = {
        "client": client, "x": batch.x, "y": batch.y, "task": int(batch.task),
        "index": int(batch.index), "end_of_task": bool(batch.end_of_task),
    }
    if batch.y.dtype.kind == "U":
        names, inverse = np.unique(batch.y, return_inverse=True)
        if len(names) > MAX_LABELS:
            raise CodecError("limits", f"{len(names)} labels in one batch > limit {MAX_LABELS}")
        body["names"] = [str(n) for n in names.tolist()]
        body["y"] = inverse.reshape(-1).astype(np.uint16)
    return encode(Message("stream", body), fleet=fleet, sender=sender, wire_dtype=wire_dtype)


# ---------------------------------------------------------------- decode



def _decode_update(m: dict[str, Any], limits: Limits) -> Update:
    counts = m.get("class_counts")
    valid = isinstance(counts, dict) and all(
        type(k) is int and type(v) is int and v >= 0 for k, v in counts.items()
    )
    if counts is not None and not valid:
        raise CodecError("malformed", "class_counts must map int class -> non-negative int")
    n = _get(m, "num_samples", int)
    if n < 0:
        raise CodecError("malformed", "num_samples must be >= 0")
    return Update(
        client=_get(m, "client", str), base_version=_get(m, "base_version", int),
        seq=_get(m, "seq", int), task=_get(m, "task", int), batch=_get(m, "batch", int),
        num_samples=n, tensors=_decode_tensors(m.get("tensors"), limits),
        encoding=_get(m, "encoding", str), class_counts=counts,
        prototypes=_decode_prototypes(m.get("prototypes")),
    )


def _decode_value(v: Any, name: str) -> Any:
    if _is_tensor_map(v):
        return decode_tensor(v, name)
    if isinstance(v, dict):
        return {k: _decode_value(x, f"{name}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_decode_value(x, f"{name}[{i}]") for i, x in enumerate(v)]
    return v


def _decode_message(kind: str, m: dict[str, Any]) -> Message:
    body = {k: _decode_value(v, str(k)) for k, v in m.items() if k not in RESERVED_KEYS}
    check = KINDS[kind].check
    return Message(kind, body if check is None else check(body), m["fleet"], m["sender"])


PEEK_BYTES = 512
"""How far into a payload `peek_seq` reads (an update's sequence number is in its first
hundred bytes: the envelope, the client and the base version come before it)."""


def peek_seq(payload: bytes) -> int | None:
    """An update's or tick's sequence number, read from the payload's first PEEK_BYTES without
    decoding or checking anything (None where it is not there as `to_map` puts it: among the
    first 8 entries, after scalars only). For the daemon's pace check before it decodes an
    update (`UpdateQuota.admit`); the decoded message is checked in full after."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=PEEK_BYTES)
        unpacker.feed(bytes(payload[:PEEK_BYTES]))
        for _ in range(min(unpacker.read_map_header(), 8)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if not isinstance(value, (str, int)):
                return None
            if key == "seq":
                return value if type(value) is int else None
    except Exception:  # cut short, not a map, junk: no number to pace by
        return None
    return None


def decode(
    payload: bytes, expect_fleet: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
    require_digest: bool = False, limits: Limits = DEFAULT_LIMITS,
) -> Update | Tick | GlobalModel | Message:
    """Decode and validate one payload; raise CodecError(reason) if it must be rejected.

    Order: size, then the structure limits on the raw bytes (`transport.bounds.scan`: nesting
    depth, object count, declared lengths; "limits" or "malformed"), then the digest ("digest";
    a missing one only if `require_digest`), and only then is anything allocated and decoded.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError("malformed", f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise CodecError("oversized", f"{len(payload)} bytes > limit {max_bytes}")
    scan(payload, limits)
    intact = integrity.check(payload)
    if intact is False:
        if integrity.sealed_before_sha256(payload):
            raise CodecError("digest", "payload sealed with the BLAKE2b digest of an older "
                             "edgefcl build: update the sender")
        raise CodecError("digest", "payload digest mismatch: the bytes were damaged after encoding")
    if intact is None and require_digest:
        raise CodecError("digest", "payload carries no digest; encode it with edgefcl's codec")
    return _decode(payload, expect_fleet, limits)


def _decode(
    payload: bytes, expect_fleet: str | None, limits: Limits
) -> Update | Tick | GlobalModel | Message:
    try:
        m = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, ValueError...)
        raise CodecError("malformed", f"not a msgpack payload ({type(e).__name__})") from None
    if not isinstance(m, dict):
        raise CodecError("malformed", "payload is not a msgpack map")
    schema = m.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise CodecError("schema", f"schema {schema!r}, this build speaks {SCHEMA_VERSION}")
    kind = _get(m, "kind", str)
    form = KINDS[kind].form if kind in KINDS else None
    if form is None:
        raise CodecError("kind", f"unknown message kind {kind!r}")
    if form == "chunk":
        raise CodecError("kind", "chunk payloads must be reassembled first (transport.chunks)")
    fleet = _get(m, "fleet", str)
    _get(m, "sender", str)
    if expect_fleet is not None and fleet != expect_fleet:
        raise CodecError("fleet", f"payload is for fleet {fleet!r}, expected {expect_fleet!r}")
    return _DECODERS[form](kind, m, limits)


def _decode_tick(kind: str, m: dict[str, Any], limits: Limits) -> Tick:
    return Tick(client=_get(m, "client", str), seq=_get(m, "seq", int),
                task=_get(m, "task", int), batch=_get(m, "batch", int))


def _decode_global(kind: str, m: dict[str, Any], limits: Limits) -> GlobalModel:
    parts = m.get("participants")
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CodecError("malformed", "participants must be a list of strings")
    counted = m.get("counted", {})
    if (not isinstance(counted, dict) or not set(counted) <= set(parts)
            or any(type(s) is not int or s < 1 for s in counted.values())):
        raise CodecError("malformed", "counted must map participants to positive ints")
    run = m.get("run")
    if run is not None and (not isinstance(run, str) or not 0 < len(run) <= 64):
        raise CodecError("malformed", "run must be a string of 1 to 64 characters")
    return GlobalModel(
        version=_get(m, "version", int), tensors=_decode_tensors(m.get("tensors"), limits),
        participants=tuple(parts), prototypes=_decode_prototypes(m.get("prototypes")),
        counted=dict(counted), run=run,
    )


_DECODERS: dict[str, Callable[[str, dict[str, Any], Limits], Any]] = {
    "update": lambda kind, m, limits: _decode_update(m, limits),
    "tick": _decode_tick,
    "global": _decode_global,
    "map": lambda kind, m, limits: _decode_message(kind, m),
}
"""The decoder of each wire form of `kinds.KINDS`."""


def as_batch(msg: Message) -> Batch:
    """The mini-batch of a decoded stream message."""
    if msg.kind != "stream":
        raise CodecError("kind", f"expected a stream message, got {msg.kind!r}")
    b = msg.body
    return Batch(x=b["x"], y=b["y"], task=b["task"], index=b["index"], end_of_task=b["end_of_task"])
