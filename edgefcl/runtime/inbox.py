"""A bounded inbox between the MQTT network thread and a daemon's main loop.

The network thread must never block and the daemon must never hold more than it can handle:
the inbox is bounded by the bytes it holds (and a message count), and a message that does not
fit is shed and counted (`shed`, `shed_bytes`) instead of queued. `load()` reports what the
inbox saw since its last call (offered, shed, taken, mean fill), for backpressure.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from edgefcl.runtime.backpressure import Load


class Inbox:
    """FIFO of (topic, item) with a byte budget; `put` never blocks, `get` waits."""

    def __init__(self, max_bytes: int, max_items: int = 10_000) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._items: deque[tuple[str, Any, int]] = deque()
        self._cond = threading.Condition()
        self.bytes = 0
        self.shed = 0
        self.shed_bytes = 0
        self.queued = 0
        self.taken = 0
        self._since = time.monotonic()  # the interval load() reports on
        self._t = self._since  # last change of `bytes`
        self._area = 0.0  # integral of bytes over time since `_since`
        self._mark = (0, 0, 0)  # queued, shed, taken at `_since`

    def _account(self) -> None:
        """Add the time since the last change of `bytes` to the fill integral (under lock)."""
        now = time.monotonic()
        self._area += self.bytes * (now - self._t)
        self._t = now

    def put(self, topic: str, item: Any) -> bool:
        """Queue `item` unless the inbox is full; returns whether it was queued."""
        size = len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0
        with self._cond:
            if self.bytes + size > self.max_bytes or len(self._items) >= self.max_items:
                self.shed += 1
                self.shed_bytes += size
                return False
            self._account()
            self._items.append((topic, item, size))
            self.queued += 1
            self.bytes += size
            self._cond.notify()
            return True

    def get(self, timeout: float) -> tuple[str, Any] | None:
        """The oldest item, or None after `timeout` seconds without one."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: self._items, timeout):
                return None
            topic, item, size = self._items.popleft()
            self._account()
            self.taken += 1
            self.bytes -= size
            return topic, item

    def load(self) -> Load:
        """Messages offered, shed and taken and the mean fill of the byte budget since the
        last call (the first call: since the inbox was made)."""
        with self._cond:
            self._account()
            span = self._t - self._since
            q, s, t = self._mark
            fill = self._area / span / self.max_bytes if span > 0 and self.max_bytes else 0.0
            load = Load(offered=self.queued - q + self.shed - s, shed=self.shed - s,
                        taken=self.taken - t, fill=fill)
            self._since, self._area = self._t, 0.0
            self._mark = (self.queued, self.shed, self.taken)
            return load

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
