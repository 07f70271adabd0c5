"""The async task gate: at the end of a task a device waits until every active device has
finished that task too (or `task_gate` seconds passed), so that devices of different speeds
train the same task at the same time and no round averages a device that just learned a
task with one still tasks behind (the cause of async's accuracy loss: docs/async.md).

Each device's claim is its own last finished task (a status field). The gate is the lowest
claim among the active devices: one device can hold the fleet back only by never claiming,
and then for at most `task_gate` seconds per task; claiming more than it did opens nothing
for anyone else."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

GATE_BURST, GATE_WINDOW_S = 8, 10.0
"""The gate's moves are announced at once, up to GATE_BURST in any GATE_WINDOW_S seconds; a
move beyond that waits until the window allows it (a device flapping offline / online moved
the gate with each status, and the retained config went to every device each time). A gate
announced late lets devices pass task ends it should hold them at: waiting 10 s to announce
a lower one took async over MQTT from 92 to 75 %."""
MAX_TASK = 1 << 20
"""Claims above this are ignored (a task index, not a number a device may inflate)."""
OPEN = MAX_TASK
"""The gate with no active device to wait for."""


class TaskGate:
    """Each client's last finished task; `passed(active)` is the gate."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = {}

    def finish(self, client: str, task: int) -> None:
        """Note that `client` finished `task` (claims only move forward)."""
        if 0 <= task <= MAX_TASK and task > self.finished.get(client, -1):
            self.finished[client] = task

    def passed(self, active: Iterable[str]) -> int:
        """The highest task every client in `active` has finished (-1: some finished none;
        `OPEN` with no active client)."""
        return min((self.finished.get(c, -1) for c in active), default=OPEN)

    def state(self) -> dict[str, int]:
        """What a restarted aggregator needs (devices also re-claim on their retained status)."""
        return dict(self.finished)

    def load_state(self, state: dict) -> None:
        """Resume from `state()` output."""
        self.finished = {}
        for client, task in state.items():
            self.finish(str(client), int(task))


def gate_open(passed: int, task: int) -> bool:
    """Whether a device at the end of `task` may go on, given the fleet's `passed`."""
    return passed >= task


class GatePace:
    """When the gate's moves may be announced (GATE_BURST in GATE_WINDOW_S): the daemon's
    rule, which the in-process async simulator follows on its virtual clock."""

    def __init__(self) -> None:
        self.times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Whether a move may be announced at `now` (counted when it may)."""
        while self.times and now - self.times[0] >= GATE_WINDOW_S:
            self.times.popleft()
        if len(self.times) >= GATE_BURST:
            return False
        self.times.append(now)
        return True
