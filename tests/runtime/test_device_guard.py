"""Attacks on a device: every global is checked against the device's own model before it is
adopted; a bad one is counted by reason, never adopted, never a crash."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefcl.build import make_client, prepare
from edgefcl.config import RunConfig, apply
from edgefcl.federation.messages import GlobalModel
from edgefcl.learn.global_format import global_tensors
from edgefcl.runtime.device_runner import DeviceRunner
from edgefcl.runtime.links import NullLink, topics
from edgefcl.transport import integrity
from edgefcl.transport.codec import Message, decode, encode


@pytest.fixture(scope="module")
def runner_factory():
    cfg = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2},
                              "learn": {"memory_size": 20}, "quiet": True,
                              "mqtt": {"fleet": "g"}})
    setup = prepare(cfg, 0)

    def make(encoding="dense", downlink="dense") -> DeviceRunner:
        c = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2},
                                "fed": {"encoding": encoding, "downlink": downlink},
                                "quiet": True, "mqtt": {"fleet": "g"}})
        r = DeviceRunner(c, make_client(c, setup, 0, "fedavg", 0))
        r.link = NullLink()
        return r

    return make


def good_tensors(r: DeviceRunner) -> dict:
    return global_tensors(r.client.model, r.cfg.fed.encoding)


def send(r: DeviceRunner, tensors: dict, version: int = 1, digest: bool = True) -> None:
    payload = encode(GlobalModel(version, tensors, ("c0",)), fleet="g")
    if not digest:
        m = msgpack.unpackb(payload)
        del m[integrity.DIGEST_KEY]
        payload = msgpack.packb(m, use_bin_type=True)
    r._on_message(topics(r.cfg.mqtt).global_, payload)


def test_a_good_global_is_adopted(runner_factory) -> None:
    r = runner_factory()
    send(r, good_tensors(r))
    assert r.latest is not None and r.latest.version == 1 and r.rejected == 0


def test_bad_globals_are_rejected_by_reason_and_never_adopted(runner_factory) -> None:
    r = runner_factory()
    good = good_tensors(r)
    name = next(iter(good))
    var = next((k for k in good if k.endswith("running_var")), None)
    attacks = {
        "shape": {**good, name: np.zeros((3, 3), np.float32)},
        "names": {**good, "extra": np.zeros(2, np.float32)},
        "range": {**good, name: np.full(good[name].shape, 3e38, np.float32)},
        "dtype": {**good, name: good[name].astype(np.int64)},
    }
    scalar = {**good, name: np.float32(1.0) * np.ones((), np.float32)}
    for reason, tensors in attacks.items():
        send(r, tensors)
        assert r.rejections[reason] >= 1, (reason, dict(r.rejections))
    send(r, scalar)
    assert r.rejections["shape"] == 2
    send(r, good, version=2**63 - 1)
    assert r.rejections["version-jump"] == 1
    send(r, good, digest=False)
    assert r.rejections["digest"] == 1
    if var is not None:
        send(r, {**good, var: -np.ones(good[var].shape, np.float32)})
        assert r.rejections["variance"] == 1
    assert r.latest is None  # nothing was adopted
    send(r, good)
    assert r.latest is not None


def test_commands_only_on_the_control_topic(runner_factory) -> None:
    r = runner_factory()
    stop = encode(Message("control", {"command": "stop"}, sender="op"), fleet="g")
    r._on_message(topics(r.cfg.mqtt).global_, stop)
    assert not r.stop.is_set() and r.rejections["kind"] == 1
    r._on_message(topics(r.cfg.mqtt).control, stop)
    assert r.stop.is_set()


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 4))
def test_mutated_globals_never_escape(runner_factory, flips, cut) -> None:
    r = _RUNNER.setdefault("r", runner_factory())  # one device for all examples
    payload = bytearray(encode(GlobalModel(1, good_tensors(r), ("c0",)), fleet="g"))
    for pos, val in flips:
        payload[pos % len(payload)] = val
    if cut:
        payload = payload[: len(payload) * cut // 5]
    before = r.rejected
    r._on_message(topics(r.cfg.mqtt).global_, bytes(payload))  # must never raise
    assert r.rejections["internal"] == 0
    assert r.rejected == before + 1 or r.latest is not None


_RUNNER: dict = {}


# ---------------------------------------------------------------- the aggregator's other bodies


def body(kind: str, **fields) -> bytes:
    return encode(Message(kind, fields, sender="aggregator"), fleet="g")


@pytest.mark.parametrize("kind,fields", [
    ("config", {"incarnation": np.zeros(2, np.float32)}),  # crashed _resend_if_restarted
    ("config", {"spec_hash": np.zeros(2, np.float32)}),  # crashed the join check
    ("config", {"method": np.zeros(2, np.float32)}),
    ("config", {"sample_shape": ["x", {}]}),
    ("status", {"state": "refused", "time": "x"}),  # crashed the join wait
    ("status", {"state": np.zeros(2, np.float32)}),
    ("answer", {"tick": 1, "version": "1", "participants": ["c000"]}),
    ("answer", {"tick": 1, "version": 1, "participants": "c000"}),
    ("answer", {"tick": 1, "version": 10**9, "participants": ["c000"]}),  # hung lock-step
    ("answer", {"version": 1, "participants": []}),
])
def test_forged_bodies_from_the_aggregator_are_rejected_not_kept(runner_factory, kind,
                                                                  fields) -> None:
    # the attack (a stolen credential with a broken ACL): bodies the codec lets through,
    # with tensors or junk where the device reads a string, a number or a list
    r = runner_factory()
    tp = topics(r.cfg.mqtt)
    topic = {"config": tp.config, "status": tp.aggregator_status, "answer": tp.tick}[kind]
    r._on_message(topic, body(kind, **fields))
    assert r.rejections["malformed"] == 1 or r.rejections["version-jump"] == 1
    assert r.fleet_config is None and r.aggregator_state is None and not r.answers
    r._on_message(tp.config, body("config", incarnation="x", spec_hash="abc", burn_in=4,
                                  run="r1"))
    r._on_message(tp.aggregator_status, body("status", state="online", time=1.0))
    r.awaited_tick = 1  # it sent tick 1's report
    r._on_message(tp.tick, body("answer", tick=1, version=1, participants=["c000"]))
    assert r.fleet_config["incarnation"] == "x" and r.aggregator_state["state"] == "online"
    assert r.answers[1]["version"] == 1
    sent = []
    r.link.publish = lambda topic, payload, **kw: sent.append(payload)
    r._status("done")  # the run it reports to: an aggregator of a later run ignores it
    assert decode(sent[-1], r.cfg.mqtt.fleet).body["run"] == "r1"


def test_answers_for_ticks_a_device_does_not_wait_on_are_not_kept(runner_factory) -> None:
    # the attack: every answer was kept (an async device never takes one), so forged
    # answers of 2,000 long names each, for ticks no one waits on, held 405 MiB
    r = runner_factory()
    tp = topics(r.cfg.mqtt)
    for tick in range(50):
        r._on_message(tp.tick, body("answer", tick=tick + 10, version=0,
                                    participants=["x" * 1000] * 100))
    assert not r.answers and r.rejected == 0
    r.awaited_tick = 7
    r._on_message(tp.tick, body("answer", tick=7, version=0, participants=[]))
    assert list(r.answers) == [7]


def test_a_lock_step_device_gives_up_on_an_answered_global_that_never_comes(
        runner_factory) -> None:
    r = runner_factory()
    r.answer_timeout = 0.05
    tp = topics(r.cfg.mqtt)
    v = r.client.version

    def send(msg, last=False) -> bytes:  # the aggregator answers the report at once
        r._on_message(tp.tick, body("answer", tick=msg.seq, version=v + 5,
                                    participants=[r.cid]))
        return b""

    r._send = send
    r._sync_round(None)  # before: waited for version v + 5 for ever
    assert r.client.version == v and r.rejections["answer_unmet"] == 1


def test_a_lock_step_device_out_of_step_with_its_fleet_gives_up_in_one_line(
        runner_factory) -> None:
    # a device deployer's (a reviewer helper's): a lock-step client restarted near a run's end
    # sent tick 1 while the fleet was at tick 40; it re-sent it every 15 s for ever, each
    # refused as a duplicate, and neither it nor the aggregator ever exited
    from edgefcl.support.errors import UserError

    r = runner_factory()
    r.answer_timeout = 0.05
    tp = topics(r.cfg.mqtt)
    sent = []

    def send(msg, last=False) -> bytes:  # the aggregator re-answers a duplicate with its last
        sent.append(msg)
        r._on_message(tp.tick, body("answer", tick=40, version=0, participants=["c1"]))
        return b""

    r._send = send
    r.link.publish = lambda *a, **k: sent.append(a)
    with pytest.raises(UserError, match="answers tick 40, past this device's tick 1"):
        r._sync_round(None)
    assert len(sent) >= 2  # it re-sent meanwhile
    # an honest device whose fleet is slow (no later tick answered) waits, however long
    r = runner_factory()
    r.answer_timeout = 0.01
    calls = []

    def slow(msg, last=False) -> bytes:
        calls.append(msg)
        return b""

    r._send = slow
    resent = []

    def publish(*a, **k):
        resent.append(a)
        if len(resent) == 50:  # 50 answer timeouts later the tick closes
            r._on_message(tp.tick, body("answer", tick=1, version=0, participants=[]))

    r.link.publish = publish
    r._sync_round(None)
    assert len(resent) == 50


def test_deltas_that_miss_a_change_fetch_the_whole_global_once_in_a_while(runner_factory,
                                                                         monkeypatch):
    # the attack: a 150-byte delta naming a base the device does not hold made it
    # re-subscribe to the retained whole global each time, which the broker then sends
    # whole down the device's link: 100 forged deltas, 100 whole globals
    from edgefcl.runtime import device_runner

    r = runner_factory(downlink="sparse")
    assert r.tracker is not None
    fetches = []
    r.link.subscribe = lambda topic, *a, **k: fetches.append(topic)
    tp = topics(r.cfg.mqtt)
    forged = encode(GlobalModel(3, {"::delta_from": np.array(12345, np.int64)}, ()),
                    fleet="g")
    now = [1000.0]
    monkeypatch.setattr(device_runner.time, "monotonic", lambda: now[0])
    for _ in range(100):
        r._on_message(tp.global_delta, forged)
        now[0] += 0.01
    assert fetches == [tp.global_] and r.refetch_pending
    r._refetch_if_due()
    assert fetches == [tp.global_]
    now[0] += device_runner.REFETCH_S  # the one asked for since is made once they passed:
    r._refetch_if_due()  # a real miss just after a fetch does not leave the device behind
    r._refetch_if_due()
    assert fetches == [tp.global_] * 2 and not r.refetch_pending


def test_a_forged_global_far_ahead_does_not_lock_the_device_out(runner_factory) -> None:
    # the attack: one valid global 10**6 versions ahead (a stolen credential, a retained
    # leftover) was adopted; every honest global after it was older, so the device never
    # merged one again, and its updates, based on the forged version, were rejected as `base`
    c = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2},
                            "fed": {"mode": "async", "downlink": "dense"}, "quiet": True,
                            "mqtt": {"fleet": "g"}})
    base = runner_factory()
    r = DeviceRunner(c, base.client)
    r.link = NullLink()
    tp = topics(r.cfg.mqtt)
    tensors = global_tensors(r.client.model, r.cfg.fed.encoding)

    def deliver(version: int, participants=()) -> None:
        r._on_message(tp.global_, encode(GlobalModel(version, tensors, tuple(participants)),
                                         fleet="g"))
        r._merge_async()

    deliver(1, [r.cid])
    deliver(1 + 10**6, ["someone"])
    assert r.client.version == 1 + 10**6  # valid, so adopted: the path is not signed
    deliver(2, [r.cid])
    deliver(3, [r.cid])  # two older globals, rising: the aggregator's, not a redelivery
    assert r.client.version == 1 + 10**6
    deliver(4, [r.cid])  # the third: the held version is not this aggregator's
    assert r.client.version == 4 and r.version_resets == 1
    for v in range(5, 9):
        deliver(v, [r.cid])
    assert r.client.version == 8 and r.version_resets == 1


def test_a_lock_step_device_also_finds_its_way_back_from_a_forged_version(
        runner_factory) -> None:
    # a forged answer naming this device and a forged global 10**6 versions ahead, both
    # valid, moved a lock-step device there; every honest answer after named an older
    # version, which it never merged again
    r = runner_factory()
    r.answer_timeout = 0.05
    tp = topics(r.cfg.mqtt)
    tensors = global_tensors(r.client.model, r.cfg.fed.encoding)
    plan = iter([10**6, 2, 3, 4, 5])  # the answered version of each tick

    def send(msg, last=False) -> bytes:  # the aggregator answers and publishes at once
        v = next(plan)
        r._on_message(tp.global_, encode(GlobalModel(v, tensors, (r.cid,)), fleet="g"))
        r._on_message(tp.tick, body("answer", tick=msg.seq, version=v, participants=[r.cid]))
        return b""

    r._send = send
    r._sync_round(None)
    assert r.client.version == 10**6
    for _ in range(3):  # versions 2, 3, 4: older, rising
        r._sync_round(None)
    assert r.client.version == 4 and r.version_resets == 1
    r._sync_round(None)
    assert r.client.version == 5


def test_a_twin_on_the_same_id_is_said_once_a_minute(runner_factory, caplog) -> None:
    # a deployer helper's report: two processes with one id kicked each other off the broker
    # once a second and split the stream, and only "lost connection" was ever said
    r = runner_factory()
    tp = topics(r.cfg.mqtt)
    mine = {"state": "online", "incarnation": r.incarnation, "time": time.time()}
    old = {"state": "online", "incarnation": "beforeme", "time": r.born - 60}  # a restart's
    twin = {"state": "online", "incarnation": "twin", "time": r.born + 1}
    with caplog.at_level("ERROR", logger="edgefcl"):
        for body in (mine, old, twin, twin):
            r._on_message(tp.status(r.cid), encode(Message("status", body), fleet="g",
                                                    sender=r.cid))
    said = [rec for rec in caplog.records if "another device process runs" in rec.getMessage()]
    assert len(said) == 1 and r.rejections["twin"] == 2 and r.rejected == 0
