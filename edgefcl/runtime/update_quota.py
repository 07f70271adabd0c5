"""Fair service under overload: a device that ignores the backpressure factor gets no more of
its updates folded than a compliant one.

While the aggregator advertises a factor above 1, each active device may have its updates
handled at most at `ratio` (1.25) times the fleet's median device rate (a token bucket per device,
refilled at that rate, holding two updates); the rates are smoothed over the status intervals.
A device sending faster (one that ignores the factor, or a very fast one while the fleet is
overloaded) has the excess shed before it is decoded, counted per device (status: flooding).
With the factor at 1 nothing is limited: spare capacity goes to whoever uses it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

SMOOTHING = 0.3
"""Weight of the last interval in a device's smoothed rate."""
BURST = 2.0
"""Updates a device's bucket holds."""
MIN_RATE = 1e-3
"""A device whose smoothed rate falls below this (updates a second) leaves `recent()`."""


class UpdateQuota:
    """Per-device update budgets, set once per status interval."""

    def __init__(self, ratio: float = 1.25) -> None:
        self.ratio = ratio
        self.counts: Counter[str] = Counter()  # this interval's updates, per device
        self.rates: dict[str, float] = {}  # smoothed updates a second, per active device
        self.tokens: dict[str, float] = {}
        self.limit: float | None = None  # updates a second per device; None: no limit
        self.shed: Counter[str] = Counter()

    def admit(self, device: str) -> bool:
        """Whether an update of `device` may be handled now (counts it either way)."""
        self.counts[device] += 1
        if self.limit is None:
            return True
        tokens = self.tokens.setdefault(device, BURST)
        if tokens < 1.0:
            self.shed[device] += 1
            return False
        self.tokens[device] = tokens - 1.0
        return True

    def recent(self) -> set[str]:
        """Devices that sent this interval, or recently enough (a smoothed rate of at least
        MIN_RATE): the active set of a daemon that keeps none (an aggregator worker)."""
        return set(self.counts) | {d for d, r in self.rates.items() if r >= MIN_RATE}

    def end_interval(self, seconds: float, active: set[str], factor: float) -> None:
        """Close an interval of `seconds`: smooth the `active` devices' rates (others are
        forgotten, so the tables stay bounded by the active set), then set the next
        interval's limit (`factor` > 1: `ratio` x the median rate) and refill the buckets."""
        now = {d: self.counts.get(d, 0) / seconds for d in active}
        rates = {d: (1 - SMOOTHING) * self.rates.get(d, r) + SMOOTHING * r
                 for d, r in now.items()}
        self.rates = rates
        self.counts.clear()
        if len(self.shed) > 1024:  # bounded: the worst offenders
            self.shed = Counter(dict(self.shed.most_common(512)))
        if factor <= 1.0 or not self.rates:
            self.limit, self.tokens = None, {}
            return
        self.limit = self.ratio * float(np.median(list(self.rates.values())))
        refill = self.limit * seconds
        self.tokens = {d: min(BURST, self.tokens.get(d, BURST) + refill) for d in active}
