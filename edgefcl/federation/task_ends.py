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
round's counted updates (`RoundClosed.carried`), so no update is counted twice. An update
over the budget is not kept; its device then misses the gate's round, as before.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from edgefcl.federation.messages import Update


class TaskEnds:
    """Each client's newest accepted update, at most `budget` bytes in all (0: no bound)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept: dict[str, tuple[Update, int]] = {}
        self.nbytes = 0

    def keep(self, update: Update) -> bool:
        """Keep `update` as its client's newest (dropping the older one); False when it does
        not fit the budget (the client then has none kept). What validating it decoded is
        not kept: it outlives its round, so its fold decodes afresh."""
        self.drop(update.client)
        update = replace(update, checked=None)
        size = update.nbytes
        if self.budget and self.nbytes + size > self.budget:
            return False
        self.kept[update.client] = (update, size)
        self.nbytes += size
        return True

    def drop(self, client: str) -> None:
        """Forget `client`'s kept update (it left, or its task's gate round closed)."""
        old = self.kept.pop(client, None)
        if old is not None:
            self.nbytes -= old[1]

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
