"""The reservoir policy ("reservoir", ER): a uniform sample of the whole stream."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from edgefcl.learn.memory import ReplayMemory, Scoring, on_host


class ReservoirMemory(ReplayMemory):
    """Reservoir sampling over the stream: every sample offered so far is stored with the same
    probability, whatever its class or task. Scores nothing."""

    name = "reservoir"

    def _offer(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
               scoring: Scoring | None) -> int:
        """Sequential reservoir sampling over the batch, vectorized: sample number t (from 0)
        goes to slot t while t < capacity, else to slot j ~ U[0, t] if j < capacity; when
        several samples pick one slot the later one wins. The draws come from the device's
        generator; the slots are worked out on the host."""
        b = y.numel()
        t = self.seen + np.arange(b, dtype=np.int64)
        u = on_host(torch.rand(b, generator=self._gen, device=self.device, dtype=torch.float64))
        j = np.minimum((u * (t + 1).astype(np.float64)).astype(np.int64), t)
        j = np.where(t < self.capacity, t, j)
        hit = j < self.capacity
        if self.capacity == 0 or not hit.any():
            return 0
        winner = np.full(self.capacity, -1, dtype=np.int64)
        np.maximum.at(winner, j[hit], np.arange(b)[hit])
        slots = np.flatnonzero(winner >= 0)
        rows = winner[slots]
        r = torch.from_numpy(rows).to(self.device)
        self._store(slots, x[r], y[r], labels[rows], task)
        self.size = min(self.seen + b, self.capacity)
        return 0
