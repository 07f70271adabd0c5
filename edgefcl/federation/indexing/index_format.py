"""What every sparse index format is: a name on the wire, an encoder and a strict decoder.

A format turns the sorted positions of the entries sent from one flattened tensor of `n`
entries into one unsigned-integer array (`w::<suffix>` on the wire) and back. `encode` may
cover more positions than asked (filler entries that make the index narrower); the caller sends
the values of every covered position. `decode` trusts nothing: it returns strictly increasing
int64 positions in [0, n) or raises `SparseError(reason)`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SparseError(ValueError):
    """A sparse payload that cannot be used; `reason` is the short tag the aggregator counts
    (names, dtype, shape, length, index-range, index-duplicate, compression, nonfinite, base)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class IndexFormat(Protocol):
    """One way to send the positions of a sparse tensor."""

    suffix: str
    """Wire key suffix: the index of tensor `w` travels as `w::<suffix>`."""

    def encode(self, pos: np.ndarray, n: int, value_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """(wire array, covered positions) for sorted unique `pos` in [0, n)."""
        ...

    def decode(self, wire: np.ndarray, n: int, count: int) -> np.ndarray:
        """Positions (int64, strictly increasing, in [0, n)); raises SparseError. `count`: the
        positions the tensor's values say there are (what a compressed index may expand to
        is bounded by it)."""
        ...

    def max_wire_bytes(self, n: int, count: int) -> int:
        """The largest uncompressed wire array a valid index of `count` positions among `n`
        entries can need."""
        ...


INDEX_FORMATS: dict[str, IndexFormat] = {}
"""Registered index formats by wire suffix (`edgefcl.federation.indexing` registers them)."""


def register(fmt: IndexFormat) -> IndexFormat:
    """Add `fmt` to INDEX_FORMATS under its suffix."""
    INDEX_FORMATS[fmt.suffix] = fmt
    return fmt


def check_flat(wire: np.ndarray, kind: str = "u") -> None:
    """Raise SparseError unless `wire` is a 1-D array of the given dtype kind."""
    if wire.dtype.kind != kind:
        raise SparseError("dtype", f"index must be unsigned integers, got {wire.dtype}")
    if wire.ndim != 1:
        raise SparseError("shape", f"index must be 1-D, got shape {wire.shape}")
