"""Structure limits checked on the raw msgpack bytes, before anything is allocated.

`msgpack.unpackb` builds every object a payload declares: a 49 MiB payload of 1.5 million empty
maps becomes a gigabyte of Python objects, and a map nested 500 deep makes any recursive walker
overflow the stack. `scan` walks the msgpack headers of a payload without building objects
(strings and binaries are skipped by their declared length) and raises CodecError when the
payload nests deeper than `max_depth`, holds more than `max_objects` objects, declares a
container or a string larger than the bytes left, is truncated, or has bytes after its end.
Its cost is bounded by `max_objects`, not by the payload size.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgefcl.transport.codec_error import CodecError


@dataclass(frozen=True)
class Limits:
    """What one payload may hold (defaults fit ResNet-18 sparse updates with room to spare)."""

    max_depth: int = 8
    """Nested containers (an update: envelope > tensors > tensor > shape is depth 4)."""
    max_objects: int = 16_384
    """msgpack objects in one payload (keys, values, shape entries...); a ResNet-18 sparse
    update has about 2,500. The scan costs about 0.5 us per object."""
    max_tensors: int = 2_048
    """Tensors in one message."""


DEFAULT_LIMITS = Limits()
STATUS_LIMITS = Limits(max_depth=6, max_objects=4_096, max_tensors=0)
"""A device's status (counters, and at the end its accuracy matrix: 50 tasks fit): the
aggregator scans one in at most about 2 ms, whatever a device sends."""

# header byte -> bytes of fixed-size payload that follow it (ints, floats, fixext incl. type)
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# header byte -> (bytes of the length field, extra bytes after it) for str/bin/ext
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
          0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
# header byte -> (bytes of the count field, items per counted entry) for arrays and maps
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def scan(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise CodecError("malformed" | "limits") unless `payload` is one msgpack object within
    `limits`; allocates nothing proportional to what the payload declares."""
    buf = bytes(payload) if not isinstance(payload, bytes) else payload
    n = len(buf)
    pos = 0
    objects = 0
    stack = [1]  # items still expected at each open level
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= n:
            raise CodecError("malformed", "payload is truncated")
        b = buf[pos]
        pos += 1
        objects += 1
        if objects > limits.max_objects:
            raise CodecError("limits", f"more than {limits.max_objects} msgpack objects")
        if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
            continue
        count = -1
        if b <= 0x8F:  # fixmap
            count = 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            count = b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            if pos + width > n:
                raise CodecError("malformed", "payload is truncated")
            pos += width + extra + int.from_bytes(buf[pos:pos + width], "big")
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            if pos + width > n:
                raise CodecError("malformed", "payload is truncated")
            count = per * int.from_bytes(buf[pos:pos + width], "big")
            pos += width
        else:  # 0xC1 is never used
            raise CodecError("malformed", f"invalid msgpack byte 0x{b:02x}")
        if pos > n:
            raise CodecError("malformed", "a string or binary runs past the end of the payload")
        if count > 0:
            if count > n - pos:  # every item takes at least one byte
                raise CodecError("malformed", f"a container declares {count} items but only "
                                 f"{n - pos} bytes follow")
            if len(stack) > limits.max_depth:
                raise CodecError("limits", f"nested deeper than {limits.max_depth} levels")
            stack.append(count)
    if pos != n:
        raise CodecError("malformed", f"{n - pos} bytes after the end of the payload")
