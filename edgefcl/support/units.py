"""Byte counts for people: SI units (1 kB = 1,000 B), the same in every table and status line."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """`n` bytes as B, kB, MB or GB (one decimal above bytes)."""
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
