"""Sparse index formats: a registry (`INDEX_FORMATS`, one module per format) and the choice of
the cheapest per tensor (`encode_cheapest`). Formats: `idx` (delta-coded gaps), `bits` (packed
bitmap), `zidx` and `zbits` (the same compressed with zlib)."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.indexing.bitmap import BITMAP
from edgefcl.federation.indexing.deflate import ZBITMAP, ZGAPS
from edgefcl.federation.indexing.gaps import GAPS
from edgefcl.federation.indexing.index_format import (
    INDEX_FORMATS,
    IndexFormat,
    SparseError,
    register,
)

for _fmt in (GAPS, BITMAP, ZGAPS, ZBITMAP):  # ties go to the earlier (cheaper to decode) one
    register(_fmt)

__all__ = ["INDEX_FORMATS", "IndexFormat", "SparseError", "decode_positions", "encode_cheapest"]


def encode_cheapest(pos: np.ndarray, n: int, value_bytes: int,
                    allowed: tuple[str, ...] | None = None) -> tuple[str, np.ndarray, np.ndarray]:
    """(suffix, wire array, covered positions) of the format with the fewest index + value
    bytes for sorted unique `pos` in [0, n); ties go to the first registered format.
    `allowed` restricts the choice to those suffixes (default: every registered format)."""
    best: tuple[int, str, np.ndarray, np.ndarray] | None = None
    for suffix, fmt in INDEX_FORMATS.items():
        if allowed is not None and suffix not in allowed:
            continue
        wire, covered = fmt.encode(pos, n, value_bytes)
        cost = wire.nbytes + covered.size * value_bytes
        if best is None or cost < best[0]:
            best = (cost, suffix, wire, covered)
    if best is None:
        raise ValueError(f"no index format among {allowed}; known: {sorted(INDEX_FORMATS)}")
    return best[1], best[2], best[3]


def decode_positions(suffix: str, wire: np.ndarray, n: int, count: int) -> np.ndarray:
    """Positions of index `wire` in format `suffix`, for `count` values among `n` entries
    (`IndexFormat.decode`); raises SparseError."""
    fmt = INDEX_FORMATS.get(suffix)
    if fmt is None:
        raise SparseError("names", f"unknown index format {suffix!r}")
    return fmt.decode(wire, n, count)
