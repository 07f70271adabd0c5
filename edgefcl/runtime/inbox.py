"""A bounded inbox between the MQTT network thread and a daemon's main loop.

The network thread must never block and the daemon must never hold more than it can handle:
the inbox is bounded by the bytes it holds (and a message count), and a message that does not
fit is shed and counted (`shed`, `shed_bytes`) instead of queued.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


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

    def put(self, topic: str, item: Any) -> bool:
        """Queue `item` unless the inbox is full; returns whether it was queued."""
        size = len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0
        with self._cond:
            if self.bytes + size > self.max_bytes or len(self._items) >= self.max_items:
                self.shed += 1
                self.shed_bytes += size
                return False
            self._items.append((topic, item, size))
            self.bytes += size
            self._cond.notify()
            return True

    def get(self, timeout: float) -> tuple[str, Any] | None:
        """The oldest item, or None after `timeout` seconds without one."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: self._items, timeout):
                return None
            topic, item, size = self._items.popleft()
            self.bytes -= size
            return topic, item

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
