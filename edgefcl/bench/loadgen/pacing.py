"""How a simulated fleet's updates fall due: the pacings that `bench backpressure` (on its
virtual clock) and `bench fleet`'s load generator (over the broker) share."""

from __future__ import annotations

PACINGS = ("random", "synchronised", "bursty")
"""random: each device starts at a random phase of its period; synchronised: every device's
first update falls due at the same instant; bursty: synchronised, with updates due only in
the first BURST_ON s of every BURST_EVERY s."""
BURST_ON, BURST_EVERY = 10.0, 40.0


def in_burst(due: float, period: float, start: float = 0.0) -> float:
    """`due` when it falls in an on-window of bursty pacing (the first BURST_ON s of every
    BURST_EVERY s from `start`), else the same phase of its period in the next one."""
    rel = due - start
    if loaded(rel, "bursty"):
        return due
    return start + (rel // BURST_EVERY + 1) * BURST_EVERY + rel % period


def loaded(second: float, pacing: str) -> bool:
    """Whether devices paced by `pacing` have updates due `second` s after their start
    (bursty: in its on-windows)."""
    return pacing != "bursty" or second % BURST_EVERY < BURST_ON


def loaded_seconds(t0: float, t1: float, pacing: str) -> float:
    """Seconds of [t0, t1] (from the devices' start) in which they have updates due."""
    if pacing != "bursty":
        return max(t1 - t0, 0.0)
    total, w = 0.0, 0.0
    while w < t1:
        total += max(0.0, min(t1, w + BURST_ON) - max(t0, w))
        w += BURST_EVERY
    return total
