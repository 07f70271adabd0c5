"""Index formats `zidx` and `zbits`: another format's array compressed with zlib (stdlib).

Wire: uint8 bytes of zlib(one byte: log2 of the inner itemsize, then the inner array's
little-endian bytes). Decompression is bounded by the largest valid inner index for the tensor
and for the number of positions its values say there are, so a small payload cannot expand
into a large one (no zip bombs: a 2.7 KB index of one value expanded to 1.8 MB, SlimResNet-18's
largest tensor, before its values were counted).
"""

from __future__ import annotations

import zlib

import numpy as np

from edgefcl.federation.indexing.bitmap import BITMAP
from edgefcl.federation.indexing.gaps import GAPS
from edgefcl.federation.indexing.index_format import IndexFormat, SparseError, check_flat

LEVEL = 9
_ITEMSIZES = (1, 2, 4, 8)


class Deflated:
    """`inner` compressed with zlib."""

    def __init__(self, inner: IndexFormat) -> None:
        self.inner = inner
        self.suffix = "z" + inner.suffix

    def encode(self, pos: np.ndarray, n: int, value_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        wire, covered = self.inner.encode(pos, n, value_bytes)
        head = bytes([_ITEMSIZES.index(wire.dtype.itemsize)])
        raw = head + wire.astype(wire.dtype.newbyteorder("<"), copy=False).tobytes()
        return np.frombuffer(zlib.compress(raw, LEVEL), np.uint8), covered

    def decode(self, wire: np.ndarray, n: int, count: int) -> np.ndarray:
        check_flat(wire)
        if wire.dtype != np.uint8:
            raise SparseError("dtype", f"a compressed index is uint8, got {wire.dtype}")
        limit = 1 + self.inner.max_wire_bytes(n, count)
        d = zlib.decompressobj()
        try:
            raw = d.decompress(wire.tobytes(), limit + 1)
        except zlib.error as e:
            raise SparseError("compression", f"not a zlib stream ({e})") from None
        if len(raw) > limit or d.unconsumed_tail:
            raise SparseError("compression", f"expands past {limit} bytes")
        if not d.eof or d.unused_data:
            raise SparseError("compression", "truncated zlib stream or bytes after its end")
        if not raw or raw[0] >= len(_ITEMSIZES):
            raise SparseError("compression", "missing or unknown itemsize header")
        itemsize = _ITEMSIZES[raw[0]]
        if (len(raw) - 1) % itemsize:
            raise SparseError("length", f"{len(raw) - 1} bytes are not whole {itemsize}-byte items")
        return self.inner.decode(np.frombuffer(raw, f"<u{itemsize}", offset=1), n, count)

    def max_wire_bytes(self, n: int, count: int) -> int:
        return self.inner.max_wire_bytes(n, count)


ZGAPS = Deflated(GAPS)
ZBITMAP = Deflated(BITMAP)
