"""Wire form of a worker's partial aggregate (kind "partial", worker -> root on
`<root>/<fleet>/partial/<worker>`), of its claim before a flush (kind "claim", same topic) and
of the root's grant in reply (kind "grant", root -> worker on `<root>/<fleet>/grant/<worker>`).

The strategy's nested `partial()` dict is flattened into `tensors` (path -> float64 array,
path levels joined by "/") and `scalars` (path -> number); the envelope, size limits, the
structure scan and the digest are the codec's (`transport.codec`), as for every message.
`decode_partial` then checks what a partial may claim: the sender is the worker the topic
names, every tensor is float64, finite, named after a global tensor (its last path level)
with that tensor's shape (or flat with its size), weights, precisions and counts are not
negative, and the participants are distinct valid client ids with integer sequence numbers.
A partial is trusted only from worker identities: the broker's ACL lets only workers publish
on `partial/<id>` (broker/README.md), and the root takes partials only from the worker
ids it is configured with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from edgefcl.federation.shard import Partial
from edgefcl.transport.bounds import DEFAULT_LIMITS, Limits
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, Message, decode, encode
from edgefcl.transport.codec_error import CodecError
from edgefcl.transport.topics import validate_id

SEP = "/"
COUNTER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""What a worker's counter may be called (the names the aggregator's counters have)."""
MAX_PARTIAL_COUNTERS = 128
"""Counters one partial may carry (a worker counts a few dozen kinds)."""
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


def decode_worker_message(payload: bytes, fleet: str, spec: dict[str, tuple[int, ...]], *,
                          worker: str, cap: int, max_bytes: int = DEFAULT_MAX_BYTES,
                          limits: Limits = DEFAULT_LIMITS) -> Partial | tuple[int, list[str]]:
    """A partial (`decode_partial`) or a claim (`decode_claim`) sent on `partial/<worker>`,
    scanned against `limits` (the root's `partial_limits`)."""
    msg = decode(payload, fleet, max_bytes=max_bytes, require_digest=True, limits=limits)
    if isinstance(msg, Message) and msg.kind == "claim":
        return decode_claim(msg, worker=worker, cap=cap)
    return check_partial_message(msg, spec, worker=worker)


def decode_partial(payload: bytes, fleet: str, spec: dict[str, tuple[int, ...]], *,
                   worker: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Partial:
    """Decode and check a partial sent on `partial/<worker>`; raises CodecError(reason)."""
    return check_partial_message(decode(payload, fleet, max_bytes=max_bytes,
                                        require_digest=True), spec, worker=worker)


def check_partial_message(msg: object, spec: dict[str, tuple[int, ...]], *,
                          worker: str) -> Partial:
    """The Partial of a decoded message from `partial/<worker>`; raises CodecError(reason)."""
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
    clean_counters = dict(sorted(
        (k, v) for k, v in counters.items() if isinstance(k, str) and COUNTER_NAME.fullmatch(k)
        and type(v) is int and 0 <= v < 1 << 53)[:MAX_PARTIAL_COUNTERS])
    return Partial(worker, version, tuple(parts), {c: int(s) for c, s in seqs.items()},
                   unflatten(checked, scalars), clean_counters)


def _client_ids(value: object, what: str, cap: int) -> list[str]:
    if not isinstance(value, list) or len(value) > cap:
        raise CodecError("malformed", f"{what} must be a list of at most {cap} client ids")
    try:
        ids = [validate_id(c) for c in value]
    except ValueError as e:
        raise CodecError("malformed", str(e)) from None
    if len(set(ids)) != len(ids):
        raise CodecError("malformed", f"{what} names a client twice")
    return ids


def encode_claim(worker: str, claim: int, clients: Sequence[str], *, fleet: str) -> bytes:
    """Worker `worker`'s claim number `claim` for the clients of its next partial."""
    return encode(Message("claim", {"claim": int(claim), "clients": list(clients)}),
                  fleet=fleet, sender=worker)


def encode_grant(claim: int, clients: Sequence[str], *, fleet: str, sender: str) -> bytes:
    """The root's answer to claim number `claim`: the clients the partial may hold."""
    return encode(Message("grant", {"claim": int(claim), "clients": list(clients)}),
                  fleet=fleet, sender=sender)


def _counted(msg: Message, cap: int) -> tuple[int, list[str]]:
    claim = msg.body.get("claim")
    if type(claim) is not int or claim < 0:
        raise CodecError("malformed", f"a {msg.kind}'s claim number must be an int >= 0")
    return claim, _client_ids(msg.body.get("clients"), f"a {msg.kind}'s clients", cap)


def decode_claim(msg: Message, *, worker: str, cap: int) -> tuple[int, list[str]]:
    """(claim number, clients) of a claim decoded from `partial/<worker>`; at most `cap`
    distinct valid client ids; raises CodecError(reason)."""
    if msg.sender != worker:
        raise CodecError("sender", f"a claim on worker {worker}'s topic names another sender")
    return _counted(msg, cap)


def decode_grant(payload: bytes, fleet: str, *, cap: int,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[int, list[str]]:
    """(claim number, granted clients) of a grant; raises CodecError(reason)."""
    msg = decode(payload, fleet, max_bytes=max_bytes, require_digest=True)
    if not isinstance(msg, Message) or msg.kind != "grant":
        raise CodecError("kind", "expected a grant")
    return _counted(msg, cap)
