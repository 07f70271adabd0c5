"""Split large payloads into numbered chunks and reassemble them on the receiving side.

MQTT does not fragment and many brokers cap packet sizes (EMQX: 1 MB by default), so payloads
above `chunk_size` travel as chunk messages: small msgpack maps
`{schema, kind: "chunk", id, index, count, size, digest, data}` where `digest` is the sha256 of
the whole payload and `size` its length. Each chunk message is at most `chunk_size` bytes.
Payloads at or below `chunk_size` go as-is; `is_chunk` tells them apart from the outer map.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from edgefcl.transport.bounds import Limits, scan
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, SCHEMA_VERSION, CodecError

DEFAULT_CHUNK_SIZE = 1024 * 1024
CHUNK_OVERHEAD = 256
"""Bytes reserved in each chunk message for its header (the data part is chunk_size - this)."""
MIN_CHUNK_SIZE = 2 * CHUNK_OVERHEAD
MAX_ID_LEN = 64
MAX_CHUNKS = 1 << 16
"""Most chunks one transfer may declare (64 MiB in 1 KiB chunks)."""

_KEYS = ("schema", "kind", "id", "index", "count", "size", "digest", "data")
CHUNK_LIMITS = Limits(max_depth=1, max_objects=1 + 2 * len(_KEYS), max_tensors=0)
"""A chunk message is one flat map of its eight fields: scanned against this before it is
unpacked (the prefix test alone let a chunk of millions of objects reach msgpack)."""
# Chunk maps are packed with a fixed key order, so every chunk starts with these bytes.
_PREFIX = (
    bytes([0x80 | len(_KEYS)])
    + msgpack.packb("schema") + msgpack.packb(SCHEMA_VERSION)
    + msgpack.packb("kind") + msgpack.packb("chunk")
)


def is_chunk(payload: bytes) -> bool:
    """True if `payload` is a chunk message (cheap prefix test, no decoding)."""
    return bytes(payload[: len(_PREFIX)]) == _PREFIX


def split(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE, msg_id: str = "") -> list[bytes]:
    """Split `payload` into chunk messages of at most `chunk_size` bytes each.

    Returns `[payload]` unchanged when it already fits. `msg_id` must be unique per sender
    (up to 64 characters); the receiver groups chunks by it.
    """
    if chunk_size < MIN_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be at least {MIN_CHUNK_SIZE} bytes, got {chunk_size}")
    if len(payload) <= chunk_size:
        return [bytes(payload)]
    if not isinstance(msg_id, str) or not msg_id or len(msg_id) > MAX_ID_LEN:
        raise ValueError(f"msg_id must be a non-empty string of at most {MAX_ID_LEN} characters")
    step = chunk_size - CHUNK_OVERHEAD
    count = math.ceil(len(payload) / step)
    digest = hashlib.sha256(payload).digest()
    view = memoryview(payload)
    out = []
    for i in range(count):
        m = {
            "schema": SCHEMA_VERSION, "kind": "chunk", "id": msg_id, "index": i, "count": count,
            "size": len(payload), "digest": digest, "data": view[i * step:(i + 1) * step],
        }
        out.append(msgpack.packb(m, use_bin_type=True))
    return out


@dataclass
class _Transfer:
    count: int
    size: int
    digest: bytes
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0
    last: float = 0.0


def _parse(chunk: bytes, max_bytes: int) -> dict:
    if len(chunk) > max_bytes + CHUNK_OVERHEAD:
        raise CodecError("oversized", f"chunk message of {len(chunk)} bytes > limit")
    scan(chunk, CHUNK_LIMITS)
    try:
        m = msgpack.unpackb(chunk, raw=False, strict_map_key=False)
    except Exception:
        raise CodecError("malformed", "chunk is not a msgpack map") from None
    if not isinstance(m, dict) or m.get("kind") != "chunk":
        raise CodecError("malformed", "not a chunk message")
    if m.get("schema") != SCHEMA_VERSION:
        raise CodecError("schema", f"chunk schema {m.get('schema')!r}")
    types = {"id": str, "index": int, "count": int, "size": int, "digest": bytes, "data": bytes}
    for k, t in types.items():
        if type(m.get(k)) is not t:
            raise CodecError("malformed", f"chunk field {k!r} must be {t.__name__}")
    if not (0 <= m["index"] < m["count"]) or m["size"] < 0 or len(m["digest"]) != 32:
        raise CodecError("malformed", "chunk index/count/size/digest out of range")
    # every chunk but the last carries at least MIN_CHUNK_SIZE - CHUNK_OVERHEAD data bytes
    if m["count"] > 1 + m["size"] // (MIN_CHUNK_SIZE - CHUNK_OVERHEAD) or m["count"] > MAX_CHUNKS:
        raise CodecError("limits", f"chunk count {m['count']} too large for {m['size']} bytes")
    return m


class Reassembler:
    """Collect chunks (in any order, duplicates ignored) into verified whole payloads.

    Incomplete transfers are dropped after `timeout_s` without a new chunk (on the next chunk
    or on `expire()`, which a receiver calls periodically), a source's oldest one when it has
    more than `max_per_source` open, the oldest of all when more than `max_pending` are
    open, and the oldest transfer of the source holding the most bytes while all incomplete
    transfers hold more than `max_pending_bytes` (default 2 x `max_bytes`); every drop is
    counted in `dropped`. Transfers larger than `max_bytes` are
    rejected with CodecError("oversized"), implausible chunk counts with CodecError("limits");
    a digest mismatch raises CodecError("digest").
    Each transfer raises at most once: later chunks of a rejected transfer are ignored.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_pending: int = 16,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_per_source: int = 2,
        max_pending_bytes: int = 0,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.max_pending_bytes = max_pending_bytes or 2 * max_bytes
        self.timeout_s = timeout_s
        self.clock = clock
        self._open: OrderedDict[tuple[str, str], _Transfer] = OrderedDict()
        self._done: deque[tuple[str, str]] = deque(maxlen=256)
        self.completed = 0
        self.dropped = 0

    def expire(self) -> int:
        """Drop incomplete transfers idle for more than `timeout_s`; returns how many."""
        before = self.dropped
        self._expire(self.clock())
        return self.dropped - before

    @property
    def pending_bytes(self) -> int:
        """Data bytes held by incomplete transfers."""
        return sum(t.received for t in self._open.values())

    @property
    def pending(self) -> int:
        """Number of incomplete transfers held."""
        return len(self._open)

    def _expire(self, now: float) -> None:
        for key in [k for k, t in self._open.items() if now - t.last > self.timeout_s]:
            del self._open[key]
            self.dropped += 1

    def _shed_bytes(self) -> None:
        """Drop the oldest transfer of the source holding the most bytes until the incomplete
        transfers fit `max_pending_bytes`."""
        while self._open and self.pending_bytes > self.max_pending_bytes:
            held: dict[str, int] = {}
            for (src, _), t in self._open.items():
                held[src] = held.get(src, 0) + t.received
            top = max(held, key=held.__getitem__)
            del self._open[next(k for k in self._open if k[0] == top)]
            self.dropped += 1

    def add(self, chunk: bytes, source: str = "") -> bytes | None:
        """Add one chunk message; return the whole payload once all chunks are in, else None.

        `source` (e.g. the MQTT topic) namespaces message ids so senders cannot collide.
        """
        m = _parse(chunk, self.max_bytes)
        now = self.clock()
        self._expire(now)
        key = (source, m["id"])
        if key in self._done:
            return None  # a redelivery of a transfer already completed or rejected
        t = self._open.get(key)
        if t is None:
            if m["size"] > self.max_bytes:
                self._done.append(key)
                raise CodecError("oversized", f"chunked payload of {m['size']} bytes > limit")
            t = _Transfer(count=m["count"], size=m["size"], digest=m["digest"])
            mine = [k for k in self._open if k[0] == source]
            for old in mine[:max(0, len(mine) + 1 - self.max_per_source)]:
                del self._open[old]  # a source never holds more than max_per_source
                self.dropped += 1
            self._open[key] = t
            while len(self._open) > self.max_pending:
                self._open.popitem(last=False)
                self.dropped += 1
        elif (t.count, t.size, t.digest) != (m["count"], m["size"], m["digest"]):
            del self._open[key]
            self._done.append(key)
            raise CodecError("malformed", f"chunk {m['index']} of {m['id']!r} disagrees with "
                             "earlier chunks on count/size/digest")
        t.last = now
        self._open.move_to_end(key)
        if m["index"] in t.parts:
            return None
        t.parts[m["index"]] = m["data"]
        t.received += len(m["data"])
        self._shed_bytes()
        if key not in self._open:
            return None  # this very transfer was the one dropped
        if t.received > t.size:
            del self._open[key]
            self._done.append(key)
            raise CodecError("malformed", f"chunks of {m['id']!r} exceed the declared size")
        if len(t.parts) < t.count:
            return None
        del self._open[key]
        self._done.append(key)
        payload = b"".join(t.parts[i] for i in range(t.count))
        if len(payload) != t.size or hashlib.sha256(payload).digest() != t.digest:
            raise CodecError("digest", f"reassembled payload {m['id']!r} fails its sha256 digest")
        self.completed += 1
        return payload
