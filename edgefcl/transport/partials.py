"""Wire form of a worker's partial aggregate (kind "partial", worker -> root on
`<root>/<fleet>/partial/<worker>`).

The strategy's nested `partial()` dict is flattened into `tensors` (path -> float64 array,
path levels joined by "/") and `scalars` (path -> number); the envelope, size limits, the
structure scan and the digest are the codec's (`transport.codec`), as for every message.
`decode_partial` then checks what a partial may claim: the sender is the worker the topic
names, every tensor is float64, finite, named after a global tensor (its last path level)
with that tensor's shape (or flat with its size), weights, precisions and counts are not
negative, and the participants are distinct valid client ids with integer sequence numbers.
A partial is trusted only from worker identities: the broker's ACL lets only workers publish
on `partial/<id>` (broker/aclfile.example), and the root takes partials only from the worker
ids it is configured with.
"""

from __future__ import annotations

import math

import numpy as np

from edgefcl.federation.shard import Partial
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, Message, decode, encode
from edgefcl.transport.errors import CodecError
from edgefcl.transport.topics import validate_id

SEP = "/"
NONNEGATIVE = ("weight", "weights", "prec", "count")
"""Path levels whose values (and everything under them) must not be negative."""
GAUSSIAN_SUFFIX = "::mu"


def flatten(state: dict, prefix: str = "") -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Nested dict -> (path -> array, path -> number)."""
    tensors: dict[str, np.ndarray] = {}
    scalars: dict[str, float] = {}
    for k, v in state.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            if not v:
                scalars[path + SEP] = 0  # an empty level keeps its name
            t, s = flatten(v, path + SEP)
            tensors |= t
            scalars |= s
        elif isinstance(v, np.ndarray):
            tensors[path] = np.asarray(v, np.float64)
        else:
            scalars[path] = float(v) if isinstance(v, float) else int(v)
    return tensors, scalars


def unflatten(tensors: dict[str, np.ndarray], scalars: dict[str, float]) -> dict:
    """Inverse of `flatten`."""
    out: dict = {}
    for path, v in [*scalars.items(), *tensors.items()]:
        *levels, leaf = path.split(SEP)
        node = out
        for level in levels:
            node = node.setdefault(level, {})
            if not isinstance(node, dict):
                raise CodecError("malformed", f"partial path {path!r} clashes with a value")
        if leaf:
            if leaf in node:
                raise CodecError("malformed", f"partial path {path!r} given twice")
            node[leaf] = v
    return out


def encode_partial(p: Partial, *, fleet: str) -> bytes:
    tensors, scalars = flatten(p.state)
    body = {"worker": p.worker, "version": int(p.version), "participants": list(p.participants),
            "seqs": {c: int(s) for c, s in p.seqs.items()},
            "counters": {str(k): int(v) for k, v in p.counters.items()},
            "tensors": tensors, "scalars": scalars}
    return encode(Message("partial", body), fleet=fleet, sender=p.worker)


def _check_tensor(path: str, t: object, spec: dict[str, tuple[int, ...]]) -> np.ndarray:
    if not isinstance(t, np.ndarray) or t.dtype != np.float64:
        raise CodecError("dtype", f"partial tensor {path!r} must be float64")
    name = path.rsplit(SEP, 1)[-1]
    shape = spec.get(name) or spec.get(name + GAUSSIAN_SUFFIX)
    if shape is None:
        raise CodecError("names", f"partial tensor {path!r} names no global tensor")
    if tuple(t.shape) not in (tuple(shape), (math.prod(shape),)):
        raise CodecError("shape", f"partial tensor {path!r} has shape {t.shape}, not {shape}")
    if not np.isfinite(t).all():
        raise CodecError("nonfinite", f"partial tensor {path!r} is not finite")
    if any(level in NONNEGATIVE for level in path.split(SEP)[:-1]) and (t < 0).any():
        raise CodecError("negative", f"partial tensor {path!r} has negative entries")
    return t


def decode_partial(payload: bytes, fleet: str, spec: dict[str, tuple[int, ...]], *,
                   worker: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Partial:
    """Decode and check a partial sent on `partial/<worker>`; raises CodecError(reason)."""
    msg = decode(payload, fleet, max_bytes=max_bytes, require_digest=True)
    if not isinstance(msg, Message) or msg.kind != "partial":
        raise CodecError("kind", "expected a partial")
    b = msg.body
    if msg.sender != worker or b.get("worker") != worker:
        raise CodecError("sender", f"a partial on worker {worker}'s topic names another worker")
    version, parts, seqs = b.get("version"), b.get("participants"), b.get("seqs")
    tensors, scalars, counters = b.get("tensors"), b.get("scalars"), b.get("counters", {})
    if type(version) is not int:
        raise CodecError("malformed", "partial version must be an int")
    if not isinstance(parts, list) or not isinstance(seqs, dict):
        raise CodecError("malformed", "partial participants/seqs malformed")
    try:
        parts = [validate_id(c) for c in parts]
    except ValueError as e:
        raise CodecError("malformed", str(e)) from None
    if set(seqs) != set(parts) or any(type(s) is not int or s < 1 for s in seqs.values()):
        raise CodecError("malformed", "partial seqs must give one positive int per participant")
    if not isinstance(tensors, dict) or not isinstance(scalars, dict) or \
            not isinstance(counters, dict):
        raise CodecError("malformed", "partial tensors/scalars/counters must be maps")
    for path, v in scalars.items():
        ok = type(v) in (int, float) and math.isfinite(v)
        if not isinstance(path, str) or not ok:
            raise CodecError("malformed", f"partial scalar {path!r} must be a finite number")
        if path.rsplit(SEP, 1)[-1] in NONNEGATIVE and v < 0:
            raise CodecError("negative", f"partial scalar {path!r} is negative")
    checked = {str(p): _check_tensor(str(p), t, spec) for p, t in tensors.items()}
    clean_counters = {str(k): int(v) for k, v in counters.items()
                      if type(v) is int and 0 <= v < 1 << 53}
    return Partial(worker, version, tuple(parts), {c: int(s) for c, s in seqs.items()},
                   unflatten(checked, scalars), clean_counters)
