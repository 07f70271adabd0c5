"""The device's flash: one state file written atomically at safe points, and an inbox of the
stream messages it received but has not consumed yet.

Both survive `kill -9` (written through a temporary file and renamed over the old one, so a
reader sees the old or the new file, never a mix); with `fsync` they also survive power loss.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch

from edgefcl.support.statefiles import atomic_write

log = logging.getLogger("firmware_sim.flash")

STATE = "state.pt"
INBOX = "inbox"


class Flash:
    """State file `state.pt` (torch.save of a dict) and inbox `inbox/<n>.msg` (raw payloads,
    numbered in arrival order) under `root`."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.inbox_dir = self.root / INBOX
        self.inbox_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".*.*"):  # temporaries of a write cut short by a kill
            stale.unlink(missing_ok=True)
        for stale in self.inbox_dir.glob(".*.*"):
            stale.unlink(missing_ok=True)
        ids = [int(p.stem) for p in self.inbox_dir.glob("*.msg")]
        self._next = max(ids, default=0) + 1
        self.writes = 0
        self.bytes_written = 0

    @property
    def state_path(self) -> Path:
        return self.root / STATE

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None on a first boot."""
        if not self.state_path.exists():
            return None
        # our own file on the device's own storage: full unpickling is fine
        return torch.load(self.state_path, map_location="cpu", weights_only=False)

    def save(self, state: dict[str, Any]) -> int:
        """Write the state atomically; returns its size in bytes."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        atomic_write(self.state_path, data, self.fsync)
        self.writes += 1
        self.bytes_written += len(data)
        return len(data)

    # -- inbox ----------------------------------------------------------------------------
    def inbox_put(self, payload: bytes) -> int:
        """Store one received payload; returns its inbox number (increasing)."""
        n = self._next
        self._next += 1
        atomic_write(self.inbox_dir / f"{n:010d}.msg", bytes(payload), self.fsync)
        self.writes += 1
        self.bytes_written += len(payload)
        return n

    def inbox(self) -> list[tuple[int, bytes]]:
        """Every stored payload, in arrival order."""
        items = sorted((int(p.stem), p) for p in self.inbox_dir.glob("*.msg"))
        return [(n, p.read_bytes()) for n, p in items]

    def inbox_drop(self, n: int) -> None:
        """Forget a consumed payload."""
        (self.inbox_dir / f"{n:010d}.msg").unlink(missing_ok=True)
