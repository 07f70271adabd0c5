"""The async task gate: devices wait at a task's end until every active device finished it.
The gate's arithmetic by hand, the round it closes, what one device's claims can and cannot
do, and the simulator's fleet, where no device starts a task before every device finished the
one before (or the gate timed out)."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from edgefcl.build import make_client, prepare
from edgefcl.config import FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.task_gate import MAX_TASK, OPEN, TaskGate, gate_open
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.device_runner import DeviceRunner
from edgefcl.runtime.links import NullLink, topics
from edgefcl.sim import asynchronous
from edgefcl.sim.runs import simulate
from edgefcl.transport.codec import Message, decode, encode


def upd(client: str, seq: int, value: float = 1.0) -> Update:
    return Update(client, 0, seq, 0, seq, 10, {"w": np.full(2, value, np.float32)})


def test_the_gate_is_the_lowest_claim_of_the_active_clients():
    g = TaskGate()
    assert g.passed({"a", "b"}) == -1 and g.passed(set()) == OPEN
    g.finish("a", 2)
    assert g.passed({"a", "b"}) == -1  # b finished nothing yet
    g.finish("b", 1)
    assert g.passed({"a", "b"}) == 1 and g.passed({"a"}) == 2
    g.finish("a", 0)  # claims only move forward
    assert g.finished["a"] == 2
    assert gate_open(1, 1) and not gate_open(1, 2)


def test_inflated_claims_open_nothing_for_anyone_else():
    g = TaskGate()
    g.finish("liar", MAX_TASK + 1)  # ignored
    g.finish("liar2", -5)  # ignored
    assert "liar" not in g.finished and "liar2" not in g.finished
    g.finish("liar", MAX_TASK)
    assert g.passed({"liar", "honest"}) == -1  # the honest device still holds the gate


def test_the_gate_survives_a_restart():
    g = TaskGate()
    g.finish("a", 3)
    h = TaskGate()
    h.load_state(g.state())
    assert h.finished == {"a": 3}


def agg(mode: str = "async", min_clients: int = 2) -> Aggregator:
    fed = FedConfig(mode=mode, clients=3, min_clients=min_clients, burn_in=0, jump=1,
                    round_timeout=1e9, task_decay=1.0)
    a = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in ("a", "b", "c"):
        a.join(c, 0.0)
    return a


def test_opening_the_gate_closes_the_round_of_end_of_task_updates():
    a = agg()
    a.submit(upd("a", 1), 0.0)
    a.submit(upd("b", 1), 0.0)  # c has not reported: the round stays open
    assert a.rounds == 0
    for c in ("a", "b"):
        assert a.finish_task(c, 0, 0.0) is None
    closed = a.finish_task("c", 0, 0.0)  # the last device finished task 0
    assert closed is not None and closed.global_ is not None
    assert a.tasks_passed == 0 and a.counters["closed_gate"] == 1
    assert set(closed.participants) == {"a", "b"}


def test_a_gate_round_needs_min_clients_updates():
    a = agg()
    a.submit(upd("a", 1), 0.0)
    for c in ("a", "b", "c"):
        a.finish_task(c, 0, 0.0)
    assert a.tasks_passed == 0 and a.rounds == 0  # one update never makes a round alone


def test_claims_of_clients_off_the_active_set_are_ignored():
    a = agg()
    a.finish_task("stranger", 4, 0.0)
    assert "stranger" not in a.gate.finished
    a.finish_task("a", 0, 0.0)
    a.finish_task("b", 0, 0.0)
    assert a.tasks_passed == -1
    a.leave("c", 0.0)  # the laggard leaves: nobody waits for it
    assert a.tasks_passed == 0


def test_lock_step_never_closes_a_gate_round():
    a = agg(mode="sync")
    a.submit(upd("a", 1), 0.0)
    a.submit(upd("b", 1), 0.0)
    for c in ("a", "b", "c"):
        assert a.finish_task(c, 0, 0.0) is None


def small(gate: float, profile: str = "heterogeneous", seed: int = 0) -> RunConfig:
    cfg = apply(RunConfig(), {"data": {"tasks": 3}, "fed": {"mode": "async", "task_gate": gate},
                              "learn": {"local_epochs": 1}, "quiet": True})
    return dataclasses.replace(cfg, profile=profile, seed=seed)


def task_starts(monkeypatch, cfg: RunConfig) -> dict[int, list[tuple[float, float]]]:
    """Per task, each device's (first mini-batch trained, last one trained) virtual times."""
    seen: dict[tuple[int, int], list[float]] = {}
    batch = asynchronous.AsyncFleet.batch

    def spy(self, d):
        before = d.client.learner.task
        batch(self, d)
        task = d.client.learner.task
        if task is not None and (before != task or d.client.learner.batch_in_task >= 1):
            seen.setdefault((d.k, task), []).append(self.clock.now)

    monkeypatch.setattr(asynchronous.AsyncFleet, "batch", spy)
    simulate(cfg)
    out: dict[int, list[tuple[float, float]]] = {}
    for (_, task), times in sorted(seen.items()):
        out.setdefault(task, []).append((min(times), max(times)))
    return out


def test_with_the_gate_no_device_starts_a_task_before_all_finished_the_last(monkeypatch):
    spans = task_starts(monkeypatch, small(gate=60.0))
    for t in range(1, 3):
        assert min(s for s, _ in spans[t]) >= max(e for _, e in spans[t - 1])


def test_without_the_gate_fast_devices_run_tasks_ahead(monkeypatch):
    spans = task_starts(monkeypatch, small(gate=0.0))
    assert any(min(s for s, _ in spans[t]) < max(e for _, e in spans[t - 1])
               for t in range(1, 3))


def test_a_gate_that_never_opens_holds_a_device_task_gate_seconds_at_most(monkeypatch):
    """A device that never claims (here: the aggregator ignores every claim) holds the others
    `task_gate` virtual seconds per task, then they go on."""
    monkeypatch.setattr(Aggregator, "finish_task", lambda self, c, t, now=None: None)
    spans = task_starts(monkeypatch, small(gate=2.0))
    for t in range(1, 3):
        wait = min(s for s, _ in spans[t]) - min(e for _, e in spans[t - 1])
        assert 2.0 <= wait < 2.0 + 1.0  # the timeout plus one mini-batch


# -- the device and the daemon over their links (no broker: the links record) ------------------

@pytest.fixture(scope="module")
def device_setup():
    cfg = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2}, "quiet": True,
                              "mqtt": {"fleet": "g"}, "fed": {"mode": "async"}})
    return cfg, prepare(cfg, 0)


def device(device_setup, gate: float) -> DeviceRunner:
    cfg, setup = device_setup
    cfg = apply(cfg, {"fed": {"task_gate": gate}})
    r = DeviceRunner(cfg, make_client(cfg, setup, 0, "fedavg", 0))
    r.link = NullLink()
    return r


def config(r: DeviceRunner, **body) -> None:
    r._on_message(topics(r.cfg.mqtt).config,
                  encode(Message("config", {"incarnation": "a", **body}), fleet="g",
                         sender="aggregator"))


def test_a_device_waits_only_for_an_aggregator_that_advertises_the_gate(device_setup):
    r = device(device_setup, 5.0)
    assert not r._gated()
    config(r)
    assert not r._gated()  # a lock-step, sharded-off or older aggregator: no gate
    config(r, tasks_passed=-1, gate_version=0)
    assert r._gated()
    off = device(device_setup, 0.0)  # 0: the device never waits
    config(off, tasks_passed=-1, gate_version=0)
    assert not off._gated()


def test_a_device_goes_on_once_the_gate_opens_and_takes_its_global(device_setup):
    """The gate opens with version 1, which does not list the device (its last update was
    folded earlier): it still takes it, and claims the task on its status."""
    r = device(device_setup, 5.0)
    config(r, tasks_passed=-1, gate_version=0)
    g = GlobalModel(r.client.version + 1, {k: v + 1.0 for k, v in r.client.base.items()}, ())
    statuses: list[dict] = []
    r.link.publish = lambda topic, payload, **kw: statuses.append(
        decode(payload, "g").body) or len(payload)

    def fleet() -> None:
        time.sleep(0.2)
        with r.cond:
            r.latest = g
        config(r, tasks_passed=0, gate_version=1)

    threading.Thread(target=fleet).start()
    r.unanswered = 1  # an update in flight
    t0 = time.monotonic()
    r._task_gate(0)
    assert time.monotonic() - t0 < 2.0 and r.gate_timeouts == 0
    assert r.client.version == 1
    assert r.unanswered == 1  # this global does not list the device: its update still waits
    assert [s["finished_task"] for s in statuses] == [0]
    listed = GlobalModel(2, g.tensors, (r.cid,))
    with r.cond:
        r.latest = listed
    config(r, tasks_passed=1, gate_version=2)
    r._task_gate(1)
    assert r.client.version == 2 and r.unanswered == 0  # a global that counts it


def test_a_gate_that_never_opens_lets_the_device_go_on_after_task_gate_seconds(device_setup):
    r = device(device_setup, 0.3)
    config(r, tasks_passed=-1, gate_version=0)
    t0 = time.monotonic()
    r._task_gate(0)
    assert 0.3 <= time.monotonic() - t0 < 2.0 and r.gate_timeouts == 1


class Sink(NullLink):
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def publish(self, topic, payload, qos=1, retain=False, wait=False) -> int:
        self.sent.append((topic, decode(payload, "g").body))
        return len(payload)


def daemon(tmp_path, mode: str) -> AggregatorDaemon:
    cfg = apply(RunConfig(), {"fed": {"clients": 3, "mode": mode, "min_clients": 2},
                              "quiet": True, "mqtt": {"fleet": "g", "max_payload": 1 << 20}})
    d = AggregatorDaemon(cfg, {"w": np.zeros(4, np.float32)}, tmp_path / "state")
    d.link = Sink()
    return d


def configs(d: AggregatorDaemon) -> list[dict]:
    return [body for t, body in d.link.sent if t == topics(d.cfg.mqtt).config]


def test_the_daemon_announces_the_gate_when_the_last_device_claims(tmp_path):
    d = daemon(tmp_path, "async")
    d._publish_config()
    assert configs(d)[-1]["tasks_passed"] == -1
    for c in ("a", "b", "c"):
        d._on_status(c, {"state": "online", "finished_task": -1}, 0.0)
    d.link.sent.clear()
    d._on_status("a", {"state": "online", "finished_task": 0}, 0.0)
    d._on_status("b", {"state": "online", "finished_task": 3}, 0.0)  # b is ahead: no matter
    assert not configs(d)
    d._on_status("c", {"state": "online", "finished_task": 0}, 0.0)
    (body,) = configs(d)
    assert body["tasks_passed"] == 0 and body["gate_version"] == d.agg.global_.version
    d._on_status("c", {"state": "done"}, 0.0)  # c leaves: the gate moves to a's claim
    assert configs(d)[-1]["tasks_passed"] == 0
    d._on_status("a", {"state": "online", "finished_task": 2}, 0.0)
    assert configs(d)[-1]["tasks_passed"] == 2


def test_a_lock_step_daemon_advertises_no_gate(tmp_path):
    d = daemon(tmp_path, "sync")
    d._publish_config()
    assert "tasks_passed" not in configs(d)[-1]


def test_a_gate_round_needs_the_quorum_too():
    """Five active devices, quorum 0.5: a moved gate closes a round of 3 updates, not one of 2
    (a device leaving and coming back moves the gate; it must not close rounds a few own)."""
    fed = FedConfig(mode="async", clients=5, min_clients=2, quorum=0.5, burn_in=0, jump=1,
                    round_timeout=1e9, task_decay=1.0)
    a = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in "abcde":
        a.join(c, 0.0)
    for c in "abcd":
        a.finish_task(c, 0, 0.0)
    a.submit(upd("a", 1), 0.0)
    a.submit(upd("b", 1), 0.0)
    assert a.finish_task("e", 0, 0.0) is None and a.tasks_passed == 0  # 2 of 5: stays open
    a.submit(upd("c", 1), 0.0)
    a.finish_task("a", 1, 0.0)
    for c in "bcd":
        a.finish_task(c, 1, 0.0)
    closed = a.finish_task("e", 1, 0.0)  # 3 of 5 updates: the gate's round closes
    assert closed is not None and len(closed.participants) == 3


def test_a_task_free_device_never_waits_and_never_holds_the_gate(device_setup):
    cfg, setup = device_setup
    cfg = apply(cfg, {"learn": {"task_free": True}})
    r = DeviceRunner(cfg, make_client(cfg, setup, 0, "fedavg", 0))
    r.link = NullLink()
    config(r, tasks_passed=-1, gate_version=0)
    assert not r._gated() and r.finished_task == MAX_TASK
    g = TaskGate()
    g.finish("free", r.finished_task)
    g.finish("gated", 2)
    assert g.passed({"free", "gated"}) == 2


def test_the_sharded_root_closes_its_round_of_partials_when_the_gate_moves():
    from edgefcl.federation.shard import ShardRoot, ShardWorker

    fed = FedConfig(mode="async", clients=3, min_clients=2, burn_in=0, jump=1,
                    round_timeout=1e9, task_decay=1.0)
    initial = {"w": np.zeros(2, np.float32)}
    root, w = ShardRoot(initial, fed, batch_size=10), ShardWorker(initial, fed, batch_size=10)
    root.worker_online(w.worker)
    root.worker_online("w-silent")  # a second worker that never reports: no round closes
    for c in "abc":
        root.join(c, 0.0)
        w.join(c, 0.0)
    w.submit(upd("a", 1), 0.0)
    w.submit(upd("b", 1), 0.0)
    assert root.merge(w.flush(), 0.0) is None and root.rounds == 0
    for c in "ab":
        root.finish_task(c, 0, 0.0)
    closed = root.finish_task("c", 0, 0.0)
    assert closed is not None and closed.global_ is not None and root.rounds == 1
    assert set(closed.participants) == {"a", "b"}


def test_a_worker_never_closes_a_round_when_its_last_device_leaves():
    from edgefcl.federation.shard import ShardWorker

    fed = FedConfig(mode="async", clients=2, min_clients=1, burn_in=0, jump=1,
                    round_timeout=1e9, quorum=0.0)
    w = ShardWorker({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    w.join("a", 0.0)
    w.submit(upd("a", 1), 0.0)
    assert w.leave("a", 0.0) is None and w.pending() == 1  # the gate opened; the root decides
