"""The reservoir policy ("reservoir", ER): a uniform sample of the whole stream."""

from __future__ import annotations

import torch
from torch import Tensor

from edgefcl.learn.memory import ReplayMemory, Scoring


class ReservoirMemory(ReplayMemory):
    """Reservoir sampling over the stream: every sample offered so far is stored with the same
    probability, whatever its class or task. Scores nothing."""

    name = "reservoir"

    def _offer(self, x: Tensor, y: Tensor, task: int, scoring: Scoring | None) -> int:
        """Sequential reservoir sampling over the batch, vectorized: sample number t (from 0)
        goes to slot t while t < capacity, else to slot j ~ U[0, t] if j < capacity; when
        several samples pick one slot the later one wins."""
        b = y.numel()
        t = self.seen + torch.arange(b, device=self.device, dtype=torch.int64)
        u = torch.rand(b, generator=self._gen, device=self.device, dtype=torch.float64)
        j = torch.minimum((u * (t + 1).to(torch.float64)).to(torch.int64), t)
        j = torch.where(t < self.capacity, t, j)
        hit = j < self.capacity
        if self.capacity == 0 or not bool(hit.any()):
            return 0
        winner = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        src = torch.arange(b, device=self.device)[hit]
        winner.scatter_reduce_(0, j[hit], src, reduce="amax")
        slots = torch.nonzero(winner >= 0).squeeze(1)
        rows = winner[slots]
        self.x[slots], self.y[slots], self.task[slots] = x[rows], y[rows], task
        self.size = min(self.seen + b, self.capacity)
        return 0
