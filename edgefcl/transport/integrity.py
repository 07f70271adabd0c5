"""End-to-end payload integrity: a digest sealed into every encoded payload.

MQTT over TCP protects bytes on one hop, not what a device's flash, RAM, serializer or a
store-and-forward gateway does to a payload. A flipped bit in an update's tensor data still
decodes to a well-formed message, so the codec's structural checks alone cannot reject it.
`seal` packs a msgpack map whose LAST entry is `"digest": <16 bytes>`, the BLAKE2b-128 of every
byte before that digest (map header and all other entries included). The payload stays one
ordinary msgpack map. `check` verifies it on the raw bytes, without re-packing: any change to
the payload (a flipped bit anywhere, a truncation, bytes appended) makes it fail or removes the
trailer, which a receiver that requires digests rejects too.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

DIGEST_KEY = "digest"
DIGEST_BYTES = 16
_TRAILER = msgpack.packb(DIGEST_KEY) + bytes([0xC4, DIGEST_BYTES])  # key, then bin8 header
"""The bytes that precede the digest itself at the end of a sealed payload."""


def payload_digest(prefix: bytes | memoryview) -> bytes:
    """BLAKE2b-128 of the payload bytes before the digest."""
    return hashlib.blake2b(prefix, digest_size=DIGEST_BYTES).digest()


def seal(packed_map: dict[str, Any], pack) -> bytes:
    """Pack `packed_map` with `pack(map) -> bytes` and a trailing digest entry.

    `packed_map` must not hold a `digest` key (it is added last).
    """
    if DIGEST_KEY in packed_map:
        raise ValueError(f"the key {DIGEST_KEY!r} is reserved for the payload digest")
    body = pack({**packed_map, DIGEST_KEY: bytes(DIGEST_BYTES)})
    n = len(body) - DIGEST_BYTES
    return body[:n] + payload_digest(memoryview(body)[:n])


def check(payload: bytes | bytearray | memoryview) -> bool | None:
    """True: the payload carries a digest trailer that matches; False: it carries one that
    does not match; None: it carries no digest trailer."""
    view = memoryview(payload)
    start = len(view) - DIGEST_BYTES - len(_TRAILER)
    if start < 1 or bytes(view[start:start + len(_TRAILER)]) != _TRAILER:
        return None
    n = len(view) - DIGEST_BYTES
    return hmac.compare_digest(payload_digest(view[:n]), bytes(view[n:]))
