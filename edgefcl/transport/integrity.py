"""End-to-end payload integrity: a digest sealed into every encoded payload.

MQTT over TCP protects bytes on one hop, not what a device's flash, RAM, serializer or a
store-and-forward gateway does to a payload. A flipped bit in an update's tensor data still
decodes to a well-formed message, so the codec's structural checks alone cannot reject it.
`seal` packs a msgpack map whose LAST entry is `"digest": <16 bytes>`, the SHA-256 of every
byte before that digest (map header and all other entries included), truncated to 16 bytes.
The payload stays one ordinary msgpack map. `check` verifies it on the raw bytes, without
re-packing: any change to the payload (a flipped bit anywhere, a truncation, bytes appended)
makes it fail or removes the trailer, which a receiver that requires digests rejects too.

SHA-256 rather than BLAKE2b: the x86 SHA extensions (AMD Zen, Intel from Ice Lake) and ARMv8's
crypto extensions compute it in hardware, 0.25 ms for a 380 KB dense update on the 2-core
development machine against 0.68 ms for the BLAKE2b-128 that builds before it sealed with (a
third of what the aggregator spent on such an update). On CPUs without them it is slower than
BLAKE2b (not measured here). A payload sealed the older way is still told apart
(`sealed_before_sha256`), so that its rejection says what to fix.
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


def digester(prefix: bytes | memoryview = b"") -> Any:
    """A running hash of payload bytes, fed `prefix`; its `digest()[:DIGEST_BYTES]` seals."""
    return hashlib.sha256(prefix)


def payload_digest(prefix: bytes | memoryview) -> bytes:
    """The digest of the payload bytes before it: SHA-256, truncated to DIGEST_BYTES."""
    return digester(prefix).digest()[:DIGEST_BYTES]


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


def sealed_before_sha256(payload: bytes | bytearray | memoryview) -> bool:
    """Whether `payload`'s digest is the BLAKE2b-128 that edgefcl 0.1 builds before the
    SHA-256 digest sealed with (a sender to update, not damaged bytes)."""
    view = memoryview(payload)
    n = len(view) - DIGEST_BYTES
    if n < 1:
        return False
    old = hashlib.blake2b(view[:n], digest_size=DIGEST_BYTES).digest()
    return hmac.compare_digest(old, bytes(view[n:]))
