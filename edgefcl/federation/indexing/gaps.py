"""Index format `idx`: delta-coded positions (the first absolute, then the gaps to the previous
one) in the smallest unsigned dtype that holds the largest gap; when a few long gaps would force
a wider dtype, filler entries inside them are covered as well if that is smaller overall."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.indexing.index_format import SparseError, check_flat

INDEX_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


def index_dtype(largest: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds `largest` (>= 0)."""
    for dt in INDEX_DTYPES:
        if largest <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"index {largest} does not fit in 64 bits")


def encode_indices(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions -> gaps (first one absolute) in the smallest uint dtype."""
    pos = np.asarray(positions, np.int64).ravel()
    gaps = np.diff(pos, prepend=0)
    if pos.size and (pos[0] < 0 or (gaps[1:] <= 0).any()):
        raise ValueError("positions must be non-negative and strictly increasing")
    return gaps.astype(index_dtype(int(gaps.max()) if gaps.size else 0))


def decode_indices(codes: np.ndarray, n: int) -> np.ndarray:
    """Gaps -> positions (int64), checked: every position in [0, n), strictly increasing.

    Raises SparseError("dtype" | "shape" | "index-range" | "index-duplicate").
    """
    check_flat(codes)
    if codes.size == 0:
        return np.zeros(0, np.int64)
    if codes.size > n or int(codes.max()) >= n:
        raise SparseError("index-range", f"{codes.size} indices into {n} entries")
    # every gap < n and at most n gaps: the running sum stays below n * n (no overflow)
    pos = np.cumsum(codes, dtype=np.int64)
    if (codes[1:] == 0).any():
        raise SparseError("index-duplicate", "an index repeats (zero gap)")
    if pos[-1] >= n:
        raise SparseError("index-range", f"index {int(pos[-1])} >= {n} entries")
    return pos


def pad_gaps(positions: np.ndarray, value_bytes: int) -> np.ndarray:
    """`positions` plus filler positions (every M-th entry inside gaps longer than M) so that
    the gaps fit a narrower index dtype, when that makes idx + values smaller.

    Fillers are real entries: the caller sends their true values. For a uint8 index
    (M = 255) a gap of 600 gets fillers 255 and 510 after its start.
    """
    pos = np.asarray(positions, np.int64)
    if pos.size == 0:
        return pos
    starts = np.concatenate([[0], pos[:-1]])
    gaps = pos - starts
    best, best_cost = pos, None
    for dt in INDEX_DTYPES:
        m = int(np.iinfo(dt).max)
        fill = np.maximum((gaps - 1) // m, 0)
        total = int(fill.sum())
        cost = (pos.size + total) * (np.dtype(dt).itemsize + value_bytes)
        if best_cost is None or cost < best_cost:
            if total:
                step = np.arange(total) - np.repeat(np.cumsum(fill) - fill, fill) + 1
                fillers = np.repeat(starts, fill) + step * m
                best = np.sort(np.concatenate([pos, fillers]))
            else:
                best = pos
            best_cost = cost
        if total == 0:
            break  # wider dtypes only cost more
    return best


class Gaps:
    """Delta-coded positions (see the module docstring)."""

    suffix = "idx"

    def encode(self, pos: np.ndarray, n: int, value_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        covered = pad_gaps(pos, value_bytes)
        return encode_indices(covered), covered

    def decode(self, wire: np.ndarray, n: int, count: int) -> np.ndarray:
        return decode_indices(wire, n)

    def max_wire_bytes(self, n: int, count: int) -> int:
        return 8 * min(count, n)  # one item a position, fillers included


GAPS = Gaps()
