"""Each active device's newest update, kept for the task gate's round (async).

When the task gate opens, every active device has finished the task and sent its end-of-task
update. The open round holds the ones not folded yet. A device whose end-of-task update an
earlier round folded (that round closed before the others finished) would be missing from the
gate's round, and the global every device then evaluates the task on would average what the
others learned with an older global, or not close at all below `min_clients`. Where a task
takes fewer mini-batches than an answer takes to come back, that is most tasks: the task ends
near 0 (docs/async.md, "Tiny tasks on a slow link").

`TaskEnds` keeps a reference to each device's newest accepted update, within a byte budget,
so that the gate's round holds every active device's end-of-task model. A kept update that a
round already counted is *carried* into the gate's round: it is reported apart from the
round's counted updates (`RoundClosed.carried`), so no update is counted twice. The budget is
shared fairly: an update that does not fit evicts the largest kept updates that are over a
device's share of the budget and larger than itself (`evicted`); else it is not kept, and its
device misses the gate's round, as before. (First come, first served, one device's valid
sparse update of every entry, 19x an honest one, took the budget of 8 of 20 devices.)
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import replace

from edgefcl.federation.messages import Update


class TaskEnds:
    """Each client's newest accepted update, at most `budget` bytes in all (0: no bound)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept: dict[str, tuple[Update, int]] = {}
        self.nbytes = 0
        self.evicted = 0
        """Kept updates evicted for a smaller one (their devices were over their share)."""
        self._largest: list[tuple[int, str, int]] = []  # (-size, client, stamp), lazily
        self._stamps: dict[str, int] = {}  # client -> the stamp of its kept update
        self._stamp = 0

    def keep(self, update: Update, devices: int = 1) -> bool:
        """Keep `update` as its client's newest (dropping the older one), evicting, while it
        does not fit the budget, the largest kept updates over the share of one of `devices`
        and larger than it; False when it still does not fit (the client then has none kept).
        What validating it decoded is not kept: it outlives its round, so its fold decodes
        afresh."""
        self.drop(update.client)
        update = replace(update, checked=None)
        size = update.nbytes
        if self.budget and self.nbytes + size > self.budget and not self._evict(
                size, max(size, self.budget // max(devices, 1))):
            return False
        self.kept[update.client] = (update, size)
        self._stamp += 1
        self._stamps[update.client] = self._stamp
        if len(self._largest) > 2 * len(self.kept) + 64:  # drop the stale entries
            self._largest = [(-n, c, self._stamps[c]) for c, (_, n) in self.kept.items()
                             if c != update.client]
            heapq.heapify(self._largest)
        heapq.heappush(self._largest, (-size, update.client, self._stamp))
        self.nbytes += size
        return True

    def _evict(self, size: int, above: int) -> bool:
        """Evict the largest kept updates of more than `above` bytes until `size` more fit;
        whether they do."""
        while self.nbytes + size > self.budget:
            while self._largest and self._stamps.get(self._largest[0][1]) != (
                    self._largest[0][2]):  # an update no longer kept
                heapq.heappop(self._largest)
            if not self._largest or -self._largest[0][0] <= above:
                return False
            self.drop(heapq.heappop(self._largest)[1])
            self.evicted += 1
        return True

    def drop(self, client: str) -> None:
        """Forget `client`'s kept update (it left, or its task's gate round closed)."""
        old = self.kept.pop(client, None)
        if old is not None:
            self.nbytes -= old[1]
            del self._stamps[client]

    def carry(self, task: int, present: Collection[str], active: Collection[str]
              ) -> dict[str, Update]:
        """The kept updates of task `task` from active clients with none in the round
        (`present`): their end-of-task updates, already counted by an earlier round."""
        return {c: u for c, (u, _) in sorted(self.kept.items())
                if c in active and c not in present and u.task == task}

    def forget_tasks(self, upto: int) -> None:
        """Forget the kept updates of tasks up to `upto` (the gate passed them)."""
        for c in [c for c, (u, _) in self.kept.items() if u.task <= upto]:
            self.drop(c)
