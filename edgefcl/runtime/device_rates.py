"""Each device's update rate, from the times of its last updates.

A rate smoothed over status intervals (counts over intervals of 2 s) is lowest just before
each update of a device that sends less than once an interval: a device due every 7 s read
0.05/s at each of its updates, sending 0.14/s, so every one of them found it within a limit of
0.08/s. The times of a device's last updates tell its rate at any speed: the updates over the
time they span, over the last HORIZON_S (at least MIN_UPDATES of them, at most MAX_UPDATES),
and no more than one over the time since its last update (a device gone quiet slows down as
it stays quiet). A device that sent in bursts has the gap between them forgotten after
MIN_UPDATES updates of the next one (an average of gaps kept it for tens of updates).
"""

from __future__ import annotations

from collections import deque

HORIZON_S = 6.0
"""Seconds of updates a rate is taken over (three status intervals)."""
MIN_UPDATES = 4
"""Updates a rate is taken over at least (a slow device's last three gaps)."""
MAX_UPDATES = 16
"""Update times kept per device (a flooding device's rate is over its last 16)."""
MIN_GAP_S = 1e-3
"""A rate is at most 1 / this (updates that came at the same instant)."""


class DeviceRates:
    """The times of each device's last updates."""

    def __init__(self) -> None:
        self.times: dict[str, deque[float]] = {}

    def note(self, device: str, at: float, n: int = 1, since: float | None = None) -> None:
        """`n` updates of `device` at `at`; with `since`, spread evenly over (since, at] (the
        updates the inbox refused in an interval)."""
        if n <= 0:
            return
        times = self.times.setdefault(device, deque(maxlen=MAX_UPDATES))
        if since is None:
            times.extend([at] * min(n, MAX_UPDATES))
            return
        step = (at - since) / n  # among the interval's other updates: merged in order
        new = [since + (k + 1) * step for k in range(max(n - MAX_UPDATES, 0), n)]
        merged = sorted([*times, *new])[-MAX_UPDATES:]
        times.clear()
        times.extend(merged)

    def last(self, device: str) -> float | None:
        """When `device` sent last (None: never seen)."""
        times = self.times.get(device)
        return times[-1] if times else None

    def gap(self, device: str) -> float | None:
        """Seconds between `device`'s last two updates (None: fewer than two seen)."""
        times = self.times.get(device)
        return times[-1] - times[-2] if times is not None and len(times) > 1 else None

    def within_periods(self, device: str, now: float, periods: float) -> bool:
        """Whether `device`'s last update is less than `periods` of its mean periods (between
        its kept updates) before `now`; False for a device seen fewer than twice."""
        times = self.times.get(device)
        if times is None or len(times) < 2:
            return False
        return now - times[-1] < periods * (times[-1] - times[0]) / (len(times) - 1)

    def rate(self, device: str, now: float, span: float) -> float:
        """Updates a second of `device` at `now` (see the module's docstring); a device seen
        once: one update over `span` (a status interval), or over the time since when
        longer; 0 for one never seen."""
        times = self.times.get(device)
        if not times:
            return 0.0
        quiet = now - times[-1]
        if len(times) == 1:
            return 1.0 / max(span, quiet, MIN_GAP_S)
        first = len(times) - MIN_UPDATES if len(times) > MIN_UPDATES else 0
        while first > 0 and times[first - 1] >= now - HORIZON_S:
            first -= 1
        gaps = len(times) - 1 - first
        mean = (times[-1] - times[first]) / gaps
        return 1.0 / max(mean, quiet, MIN_GAP_S)

    def keep(self, devices: set[str]) -> None:
        """Forget every device but `devices` (the tables stay bounded)."""
        self.times = {d: t for d, t in self.times.items() if d in devices}
