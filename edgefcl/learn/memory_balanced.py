"""The class-balanced policies' shared step (`BalancedMemory`) and the class-balanced random
policy ("balanced-random", CBR).

Class-balanced update (docs/algorithms.md §1, step 2): while a batch fits it is appended;
then candidates = memory + batch. The per-class allotment is water-filling: the largest
integer q with sum_c min(n_c, q) <= capacity; classes with n_c <= q keep all their candidates,
over-quota classes keep q each and the leftover slots go one each to over-quota classes in a
fixed random priority order (drawn once per class, when its label is first offered), so the
memory stays exactly full (with `current_share="stream"` the current task's classes are first
capped at the task's share of the samples offered so far: `stream_paced`). Which candidates
an over-quota class keeps is the policy's: a uniform draw here, a ranking by scores in
`memory_scored`.

The allotment is worked out on the host in numpy from the small label arrays (the memory's host
copies: nothing is read back from the device for it), where torch's per-operation cost
dominated; the samples stay on the device.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from edgefcl.learn.memory import Replacement, ReplayMemory, Scoring, on_host, stream_paced
from edgefcl.learn.selection import Candidates


@dataclass(frozen=True)
class Allotment:
    """How the candidates (memory slots, then the batch) of a full memory share its capacity,
    on the host: inv, (n,) group index of every candidate; counts, (m,) candidates per group;
    keep, (m,) kept samples per group; current, (m,) the groups of the batch's task."""

    inv: np.ndarray
    counts: np.ndarray
    keep: np.ndarray
    current: np.ndarray


class BalancedMemory(ReplayMemory):
    """A memory whose groups (`grouping`: classes by default) share the capacity: appends
    while the batch fits, then every group keeps its allotment (`_allot`); a subclass picks
    which candidates an over-quota group keeps (`_replace`)."""

    def _offer(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
               scoring: Scoring | None) -> int:
        b = y.numel()
        self._note_classes(self._groups(labels, task))
        scored = 0
        if self.size + b <= self.capacity:
            sl = slice(self.size, self.size + b)
            self._store(sl, x, y, labels, task)
            self.score[sl], self.score_version[sl] = 0.0, -1
            self._version_host[sl] = -1
            self.size += b  # nothing is dropped: no score decides anything
        elif self.capacity > 0:
            replacement = self._replace(x, y, labels, task, scoring)
            scored = replacement.scored
            if self.defer:
                self.deferred = replacement
            else:
                replacement.choose()
        self.current_seen = self._task_seen(task) + b
        self.current_task = task
        return scored

    @abstractmethod
    def _replace(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
                 scoring: Scoring | None) -> Replacement:
        """Memory + batch exceed the capacity: every group keeps its allotment (`_allot`); the
        candidates to choose from, and `_keep` to write the choice."""

    def _allot(self, y: np.ndarray, task: int,
               assumed: tuple[np.ndarray, np.ndarray] | None = None) -> Allotment:
        """The groups and allotments of memory + a batch of `task` with labels `y`; `assumed`:
        (groups not offered yet, their leftover priorities) to plan as if they were known."""
        size, b = self.size, y.size
        yc = np.concatenate([self._y_host[:size], y])
        tc = np.concatenate([self._task_host[:size], np.full(b, task, dtype=np.int64)])
        labels, inv, counts = np.unique(self.grouping.key(yc, tc), return_inverse=True,
                                        return_counts=True)
        classes, priority = self._classes, self._priority
        if assumed is not None:
            order = np.argsort(np.concatenate([classes, assumed[0]]))
            classes = np.concatenate([classes, assumed[0]])[order]
            priority = np.concatenate([priority, assumed[1]])[order]
        prio = priority[np.searchsorted(classes, labels)]
        # A group of the current task: any of its candidates belongs to `task`.
        current = np.zeros(labels.size, dtype=bool)
        current[inv[tc == task]] = True
        if self.current_share == "stream" and not current.all():
            share = self.capacity * (self._task_seen(task) + b) // (self.seen + b)
            keep = stream_paced(counts, prio, current, share, self.grouping, self.capacity)
        else:
            keep = self.grouping.allot(counts, prio, self.capacity)
        return Allotment(inv, counts, keep, current)

    def _cached_scores(self, y: Tensor) -> tuple[Tensor, Tensor, np.ndarray]:
        """The candidates' cached scores and their versions (a batch row has none: -1), and
        the versions on the host."""
        size = self.size
        return (torch.cat([self.score[:size], torch.zeros(y.numel(), device=self.device)]),
                torch.cat([self.score_version[:size], torch.full_like(y, -1)]),
                np.concatenate([self._version_host[:size], np.full(y.numel(), -1, np.int64)]))

    def _keep(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int, kept: np.ndarray,
              sc: Tensor, vc: Tensor, versions: np.ndarray) -> None:
        """Keep the candidates of host mask `kept` (with their scores `sc`, versions `vc`, on
        the host `versions`): the kept batch rows go to the dropped samples' slots and the free
        tail, so [0, capacity) is filled afterwards."""
        dev, size, cap = self.device, self.size, self.capacity
        free = np.concatenate([np.flatnonzero(~kept[:size]), np.arange(size, cap)])
        rows = np.flatnonzero(kept[size:])
        r = torch.from_numpy(rows).to(dev)
        at = self._store(free, x[r], y[r], labels[rows], task)
        self.score[at], self.score_version[at] = sc[size + r], vc[size + r]
        self._version_host[free] = versions[size + rows]
        self.size = cap

    def _task_seen(self, task: int) -> int:
        """Samples of `task` offered before this batch (0 unless it is the last batch's task)."""
        return self.current_seen if task == self.current_task else 0

    def _groups(self, y: np.ndarray, task: int) -> np.ndarray:
        """The group of every sample of a batch of `task` with labels `y`."""
        return self.grouping.key(y, np.full_like(y, task))

    def _known(self, groups: np.ndarray) -> np.ndarray:
        """Which of `groups` were offered before (a binary search of the sorted groups, far
        cheaper than np.isin on arrays this small)."""
        classes = self._classes
        if classes.size == 0:
            return np.zeros(groups.shape, dtype=bool)
        return classes[np.searchsorted(classes, groups).clip(max=classes.size - 1)] == groups

    def _note_classes(self, groups: np.ndarray) -> None:
        """Register groups never offered before, each with a random leftover priority."""
        unknown = ~self._known(groups)
        if not unknown.any():
            return
        new = np.unique(groups[unknown]).astype(np.int64)
        # drawn from the device's generator, as always (read back only for new groups)
        prio = on_host(torch.rand(new.size, generator=self._gen, device=self.device))
        classes = np.concatenate([self._classes, new])
        order = np.argsort(classes, kind="stable")  # distinct groups: one order
        self._classes = classes[order]
        self._priority = np.concatenate([self._priority, prio])[order]


class BalancedRandomMemory(BalancedMemory):
    """Class-balanced random replay (CBR): an over-quota class keeps a uniform draw of its
    candidates. Scores nothing."""

    name = "balanced-random"

    def _replace(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
                 scoring: Scoring | None) -> Replacement:
        a = self._allot(labels, task)
        inv, counts, keep_n = (torch.from_numpy(v).to(self.device)
                               for v in (a.inv, a.counts, a.keep))
        sc, vc, versions = self._cached_scores(y)
        return Replacement(Candidates(inv, counts, keep_n, sc, None, self._gen), None,
                           lambda kept: self._keep(x, y, labels, task, kept, sc, vc, versions))
