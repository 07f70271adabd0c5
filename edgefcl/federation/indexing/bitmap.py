"""Index format `bits`: one bit per entry of the tensor (numpy packbits, big bit order), ceil(n / 8)
bytes whatever the density; cheaper than 1-byte gaps above 1 entry in 8."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.indexing.index_format import SparseError, check_flat


class Bitmap:
    """A packed bitmap of the entries sent; the padding bits of the last byte must be 0."""

    suffix = "bits"

    def encode(self, pos: np.ndarray, n: int, value_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        mask = np.zeros(n, bool)
        mask[pos] = True
        return np.packbits(mask), np.asarray(pos, np.int64)

    def decode(self, wire: np.ndarray, n: int, count: int) -> np.ndarray:
        check_flat(wire)
        if wire.dtype != np.uint8:
            raise SparseError("dtype", f"a bitmap is uint8, got {wire.dtype}")
        if wire.size != (n + 7) // 8:
            raise SparseError("length", f"bitmap of {wire.size} bytes for {n} entries")
        bits = np.unpackbits(wire)
        if bits[n:].any():
            raise SparseError("index-range", "bits set past the last entry")
        return np.flatnonzero(bits[:n]).astype(np.int64)

    def max_wire_bytes(self, n: int, count: int) -> int:
        return (n + 7) // 8


BITMAP = Bitmap()
