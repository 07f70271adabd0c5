"""A virtual clock: a discrete-event queue. Events at the same time run in the order they were
scheduled, so a run depends on the seed and the profile alone, never on wall time."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count


class VirtualClock:
    """`at(t, fn, *args)` schedules `fn(*args)` at virtual time t; `run()` plays the events
    in time order until none is left; `now` is the time of the event running."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._order = count()

    def at(self, t: float, fn: Callable, *args: object) -> None:
        """Schedule `fn(*args)` at time `t` (never before now)."""
        heapq.heappush(self._queue, (max(t, self.now), next(self._order), fn, args))

    def after(self, dt: float, fn: Callable, *args: object) -> None:
        """Schedule `fn(*args)` `dt` seconds from now."""
        self.at(self.now + dt, fn, *args)

    def run(self) -> None:
        """Play every event, in (time, scheduling order)."""
        while self._queue:
            self.now, _, fn, args = heapq.heappop(self._queue)
            fn(*args)
