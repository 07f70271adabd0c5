"""The async fleet on a virtual clock: the same `Aggregator` the daemon wraps and the same
`Client` and merge decision (`learn.merges.merge_global`) the daemon's devices run, with the
broker replaced by delays drawn from a timing profile (`profiles.py`).

Per device, as `runtime/device_runner.py` does over MQTT: train a mini-batch (its compute
time), send the update when the schedule says so (it reaches the aggregator after the uplink
delay), merge
the newest global it has received, evaluate at the end of a task (with the task gate, after
waiting there for the fleet and taking the gate's global; `federation/task_gate.py`; and the
last task once more on the model the device ends with). At the end of its stream a
device sends its held update and waits, up to `round_timeout` + 1 s, for a global that counts
its last update, then reports done (the aggregator stops waiting for it). Globals reach every
device after its downlink delay; a device keeps only the newest (the retained global at QoS 0).
A dropout takes a device off for a while: it trains nothing, and on reconnect receives the
retained global. The aggregator polls its timeouts every `POLL_S` virtual seconds, as the
daemon does between inbox reads.

With `--batch-clients on` the devices' steps are stacked (`learn/batched.py`) although each
device learns at its own virtual time: a device's step depends only on its own state after its
previous event (a global it receives is merged at its next event, after the step), so when a
device's mini-batch is due, every device whose next event is a mini-batch steps with it, ahead
of its time, and its event later uses the update it made (`AsyncFleet.step_ahead`). Sends,
merges, evaluations and every timing stay where the profile puts them: the run is the same as
one without stacking but for float order (`tests/sim/test_async_sim.py` checks it bit for bit
with stacking turned off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from edgefcl.build import (
    for_method,
    initial_global,
    initial_prototypes,
    make_client,
    prepare,
    use_cpu_threads,
)
from edgefcl.config import RunConfig
from edgefcl.data.streams import count_batches
from edgefcl.data.types import Batch
from edgefcl.data.workload import client_stream
from edgefcl.federation.aggregator import Aggregator, RoundClosed, async_stats
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.task_gate import GatePace, gate_open
from edgefcl.federation.versions import delta_downlink, downlink_message
from edgefcl.learn.batched import FleetTrainer, batch_clients, why_alone
from edgefcl.learn.client import Client
from edgefcl.learn.merges import MERGED, merge_at_gate, merge_global
from edgefcl.outcomes.metrics import CommStats
from edgefcl.outcomes.results import RunResult
from edgefcl.sim.clock import VirtualClock
from edgefcl.sim.outcome import encoded_size, evaluate_all, run_result
from edgefcl.sim.profiles import DeviceClock, timings

POLL_S = 0.1
"""How often the aggregator checks its round timeout and silent clients (virtual seconds)."""

log = logging.getLogger(__name__)


class SimDevice:
    """One device's state in the simulator."""

    def __init__(self, k: int, client: Client, stream: Iterator[Batch], clock: DeviceClock):
        self.k = k
        self.client = client
        self.stream = stream
        self.clock = clock
        self.latest: GlobalModel | None = None
        self.unanswered = False
        self.last_base = 0
        self.waiting_until: float | None = None
        self.done = False
        self.drops = 0
        self.offline_s = 0.0
        self.gate: int | None = None
        """The task whose end the device waits at (the task gate), or None."""
        self.passed = -1
        """The newest task gate value that reached the device, and the global version the
        aggregator had when it opened."""
        self.gate_version = 0
        self.last_task: int | None = None


class AsyncFleet:
    """The event handlers of one async run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, agg: Aggregator, devices: list[SimDevice],
                 on_task_end: Callable[[SimDevice, int], None],
                 progress: Callable[[], None], trainer: FleetTrainer | None = None) -> None:
        self.cfg = cfg
        self.fed = cfg.fed
        self.agg = agg
        self.devices = devices
        self.clock = VirtualClock()
        self.comm = CommStats()
        self.on_task_end = on_task_end
        self.progress = progress
        self.round_up = 0
        self.gate_passed = -1
        self.gate_pace = GatePace()
        self.trainer = trainer
        self.due: set[int] = set()
        """The devices whose next event is a mini-batch."""
        self.ahead: dict[int, tuple[Batch | None, Update | None]] = {}
        """Per device stepped ahead of its time: the mini-batch and the update it made."""

    def run(self) -> None:
        for d in self.devices:
            self.agg.join(d.client.cid, 0.0)
            self.next_batch(d, d.clock.timing.start_s + d.clock.compute())
        self.clock.at(POLL_S, self.poll)
        self.clock.run()

    # -- devices ---------------------------------------------------------------------------
    def next_batch(self, d: SimDevice, t: float) -> None:
        """The device will have trained its next mini-batch at virtual time `t`."""
        self.due.add(d.k)
        self.clock.at(t, self.batch, d)

    def step_ahead(self, d: SimDevice) -> None:
        """Step `d` together with every device whose next event is a mini-batch and that has
        not stepped ahead yet: their updates wait in `ahead` for their events."""
        assert self.trainer is not None
        group = [e for e in self.devices
                 if e is d or (e.k in self.due and e.k not in self.ahead)]
        batches = [next(e.stream, None) for e in group]
        stepping = [(e, b) for e, b in zip(group, batches, strict=True) if b is not None]
        updates = self.trainer.step([e.client for e, _ in stepping], [b for _, b in stepping])
        self.ahead |= {e.k: (b, None) for e, b in zip(group, batches, strict=True)}
        self.ahead |= {e.k: (b, u) for (e, b), u in zip(stepping, updates, strict=True)}

    def batch(self, d: SimDevice) -> None:
        """The device finished training its next mini-batch."""
        self.due.discard(d.k)
        if self.trainer is None:
            b = next(d.stream, None)
            upd = None if b is None else d.client.step(b)
        else:
            if d.k not in self.ahead:
                self.step_ahead(d)
            b, upd = self.ahead.pop(d.k)
        if b is None:
            self.end_of_stream(d)
            return
        if upd is not None:
            self.send(d, upd)
        self.merge(d)
        self.progress()
        if b.end_of_task:
            d.last_task = b.task
            if self.fed.task_gate > 0 and not self.cfg.learn.task_free:
                self.wait_at_gate(d, b.task)
                return
            self.on_task_end(d, b.task)
        off = d.clock.drops()
        if off is not None:  # off the network; back with the retained global
            d.drops += 1
            d.offline_s += off
            self.clock.after(off, self.reconnect, d)
            return
        self.next_batch(d, self.clock.now + d.clock.compute())

    def wait_at_gate(self, d: SimDevice, task: int) -> None:
        """The task gate: send the held update (the task's last mini-batches), claim the task
        finished (a status message) and wait until every active device has finished it, or
        `task_gate` seconds; then merge the newest global and evaluate the task."""
        held = d.client.held_update()
        if held is not None:
            self.send(d, held)
        d.gate = task
        self.clock.at(d.clock.arrival(self.clock.now, "up"), self.claim, d.client.cid, task)
        self.clock.after(self.fed.task_gate, self.gate_timeout, d, task)
        self.check_gate(d)

    def gate_timeout(self, d: SimDevice, task: int) -> None:
        if d.gate == task:
            self.release(d, opened=False)

    def check_gate(self, d: SimDevice) -> None:
        """Release a device waiting at the gate once the gate is open and the global the
        aggregator had when it opened has reached the device."""
        version = d.latest.version if d.latest is not None else 0
        if d.gate is not None and gate_open(d.passed, d.gate) and version >= d.gate_version:
            self.release(d)

    def release(self, d: SimDevice, opened: bool = True) -> None:
        """Go on after the gate: merge the newest global (`merge_at_gate` when the gate
        opened, the usual rule when it timed out), evaluate the task, train the next one."""
        task, d.gate = d.gate, None
        if not opened:
            self.merge(d)
        elif (d.latest is not None and merge_at_gate(d.client, d.latest, self.fed) == MERGED
              and d.client.cid in d.latest.participants):
            d.unanswered = False  # else its last update waits for a round (end of stream)
        self.on_task_end(d, task)
        self.next_batch(d, self.clock.now + d.clock.compute())

    def gate_news(self, d: SimDevice, passed: int, version: int) -> None:
        """The fleet's task gate reached the device (the daemon's retained config)."""
        if passed > d.passed:
            d.passed, d.gate_version = passed, version
        self.check_gate(d)

    def reconnect(self, d: SimDevice) -> None:
        g = self.agg.global_
        if g.version > 0:
            self.clock.at(d.clock.arrival(self.clock.now, "down"), self.receive, d, g)
        self.next_batch(d, self.clock.now + d.clock.compute())

    def send(self, d: SimDevice, upd: Update) -> None:
        size = encoded_size(upd, self.cfg)
        self.comm.sent(d.client.cid, size)
        self.round_up += size
        d.unanswered, d.last_base = True, upd.base_version
        self.clock.at(d.clock.arrival(self.clock.now, "up"), self.arrive, upd)

    def merge(self, d: SimDevice) -> None:
        if d.latest is not None and merge_global(d.client, d.latest, self.fed) == MERGED:
            d.unanswered = False

    def receive(self, d: SimDevice, g: GlobalModel) -> None:
        """A global reached the device (it keeps the newest); a device waiting at the end of
        its stream merges at once."""
        if d.done or (d.latest is not None and d.latest.version >= g.version):
            return
        d.latest = g
        self.check_gate(d)
        if d.waiting_until is not None:
            self.merge(d)
            if not d.unanswered or g.version - d.last_base > self.fed.max_staleness:
                self.finish(d)

    def end_of_stream(self, d: SimDevice) -> None:
        final = d.client.held_update()
        if final is not None:
            self.send(d, final)
        if not d.unanswered:
            self.finish(d)
            return
        d.waiting_until = self.clock.now + self.fed.round_timeout + 1.0
        self.clock.at(d.waiting_until, self.give_up, d)

    def give_up(self, d: SimDevice) -> None:
        if not d.done:
            self.finish(d)

    def finish(self, d: SimDevice) -> None:
        """The device ends its run: its last task is evaluated again on the model it ends
        with (after the end-of-stream merge), as lock-step evaluates after the task's round."""
        if d.last_task is not None:
            self.on_task_end(d, d.last_task)
        d.done = True
        d.waiting_until = None
        self.clock.at(d.clock.arrival(self.clock.now, "up"), self.leave, d.client.cid)

    # -- the aggregator --------------------------------------------------------------------
    def arrive(self, upd: Update) -> None:
        self.closed(self.agg.submit(upd, self.clock.now))

    def claim(self, cid: str, task: int) -> None:
        self.closed(self.agg.finish_task(cid, task, self.clock.now))
        self.announce_gate()

    def leave(self, cid: str) -> None:
        self.closed(self.agg.leave(cid, self.clock.now))
        self.announce_gate()

    def poll(self) -> None:
        now = self.clock.now
        self.closed(self.agg.poll(now))
        self.closed(self.agg.expire(now))
        self.announce_gate()
        if not all(d.done for d in self.devices) or self.agg.active:
            self.clock.after(POLL_S, self.poll)

    def announce_gate(self) -> None:
        """A moved task gate reaches every device after its downlink delay (the daemon
        re-publishes its retained config, as often as `GatePace` allows)."""
        if self.fed.task_gate <= 0 or self.agg.tasks_passed == self.gate_passed \
                or not self.gate_pace.allow(self.clock.now):
            return
        self.gate_passed = self.agg.tasks_passed
        for d in self.devices:
            self.clock.at(d.clock.arrival(self.clock.now, "down"), self.gate_news, d,
                          self.gate_passed, self.agg.global_.version)

    def closed(self, c: RoundClosed | None) -> None:
        """Publish a new global: every device receives it after its downlink delay (with a
        delta downlink, the bytes counted are the change from the previous version, which a
        device following the versions applies; it is given the whole global)."""
        if c is None or c.global_ is None:
            return
        g = c.global_
        sent = (downlink_message(g, self.agg.history, g.version - 1)
                if delta_downlink(self.fed) else g)
        size = encoded_size(sent, self.cfg)
        self.comm.per_round_up.append(self.round_up)
        self.comm.per_round_down.append(size * len(self.devices))
        self.round_up = 0
        for d in self.devices:
            self.comm.received(d.client.cid, size)
            self.clock.at(d.clock.arrival(self.clock.now, "down"), self.receive, d, g)


def simulate_async(cfg: RunConfig, method: str, seed: int,
                   progress: Callable[[int, int, str], None] | None = None,
                   observe: Callable[[Client], None] | None = None) -> RunResult:
    """One async run on the virtual clock with the timing profile `cfg.profile`; the same
    seed and profile give the same run, bit for bit."""
    cfg = for_method(cfg, method)
    use_cpu_threads(cfg.learn.threads)
    start = time.perf_counter()
    per_device = timings(cfg.profile, cfg.fed.clients, seed)
    setup = prepare(cfg, seed)
    K, T = cfg.fed.clients, cfg.data.tasks
    clients = [make_client(cfg, setup, k, method, seed) for k in range(K)]
    if observe is not None:
        for c in clients:
            observe(c)
    devices = [SimDevice(k, c, client_stream(cfg, setup.tasks[k], k, seed),
                         DeviceClock(per_device[k], seed, k)) for k, c in enumerate(clients)]
    agg = Aggregator(initial_global(cfg, setup), cfg.fed, batch_size=cfg.data.batch_size,
                     prototypes=initial_prototypes(setup, cfg.fed.encoding),
                     row_prior_sigma=cfg.learn.bayes_sigma)
    acc = np.zeros((K, T, T))
    coverage = np.zeros((2, K, T), np.int64)
    total = sum(sum(count_batches(t, cfg.data.batch_size)) for t in setup.tasks)
    done = [0]

    def task_end(d: SimDevice, task: int) -> None:
        acc[d.k, task] = evaluate_all(d.client, setup.tasks[d.k])
        if d.client.protos is not None:
            coverage[:, d.k, task] = d.client.protos.coverage(
                [t.y_test for t in setup.tasks[d.k]])

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(min(done[0], total), total, f"rounds {agg.rounds}")

    trainer = FleetTrainer() if batch_clients(cfg.learn) else None
    if trainer is not None and (why := why_alone(clients[0])) is not None:
        log.warning("batch-clients: %s, so its clients train one after another", why)
    fleet = AsyncFleet(cfg, agg, devices, task_end, step, trainer)
    fleet.run()
    stats = async_stats(agg.counters) | {
        "virtual_s": round(fleet.clock.now, 3), "profile": cfg.profile,
        "drops": int(sum(d.drops for d in devices)),
        "offline_s": round(float(sum(d.offline_s for d in devices)), 3)}
    stacked = {} if trainer is None else trainer.counts()
    return run_result(cfg, method, seed, setup, clients, agg, acc, coverage, fleet.comm, start,
                      asynchrony=stats, **stacked)
