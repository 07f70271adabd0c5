"""The networked runtime over a real broker: the daemon's input validation, and lock-step MQTT
runs that must reproduce the in-process simulation bit for bit."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from edgefcl.build import prepare
from edgefcl.config import RunConfig, apply
from edgefcl.federation.messages import Update
from edgefcl.learn.params import get_tensors
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.fleet_processes import simulate_mqtt
from edgefcl.runtime.links import open_link, topics
from edgefcl.sim.runs import simulate
from edgefcl.transport.codec import encode

pytestmark = pytest.mark.mqtt


def small_config(**over) -> RunConfig:
    values = {"data": {"tasks": 2, "classes_per_task": 2},
              "learn": {"memory_size": 40, "local_epochs": 1},
              "fed": {"clients": 2, "burn_in": 2, "jump": 2}, "quiet": True}
    for k, v in over.items():
        values.setdefault(k, {}).update(v) if isinstance(v, dict) else values.update({k: v})
    return apply(RunConfig(), values)


def wait_for(pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def daemon(embedded_broker, tmp_path):
    cfg = small_config(mqtt={"broker": embedded_broker, "fleet": "t1", "max_payload": 4 << 20},
                       fed={"mode": "async", "min_clients": 2})
    initial = get_tensors(prepare(cfg, 0).initial)
    d = AggregatorDaemon(cfg, initial, tmp_path / "state", status_every=0.2)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    assert wait_for(lambda: d.link is not None and d.link.is_connected)
    yield d, cfg, initial
    d.stop_event.set()
    t.join(10)


def test_daemon_rejects_bad_updates_and_counts_them(daemon):
    d, cfg, initial = daemon
    tp = topics(cfg.mqtt)
    link = open_link(cfg.mqtt, "attacker", clean_start=True)
    fleet = cfg.mqtt.fleet

    def update(tensors, seq, client="dev"):
        return encode(Update(client, 0, seq, 0, 2, 20, tensors), fleet=fleet)

    nan = {k: v.copy() for k, v in initial.items()}
    next(iter(nan.values())).flat[0] = np.nan
    wrong_shape = {k: np.zeros((3,), np.float32) for k in initial}
    good = update(initial, 4)
    # One at a time: in async mode a newer update from a device supersedes its unread one in
    # the inbox, so a burst would count only its last message (test_backpressure covers that).
    sends = [(b"\x00garbage", "rejected_malformed"), (update(nan, 1), "rejected_nonfinite"),
             (update(wrong_shape, 2), "rejected_shape"),
             (update(initial, 3, client="other"), "rejected_sender"),
             (b"\x81" + b"x" * (5 << 20), "rejected_oversized"), (good, "accepted"),
             (good, "rejected_duplicate")]  # the last: a QoS 1 redelivery
    for payload, counter in sends:
        link.publish(tp.update("dev"), payload, wait=True)
        assert wait_for(lambda c=counter: d.agg.counters[c] == 1), (counter, dict(d.agg.counters))
    assert all(d.agg.counters[c] == 1 for _, c in sends), dict(d.agg.counters)
    assert d.agg.global_.version == 0  # nothing bad reached the global model
    link.close()


@pytest.mark.parametrize("broker", ["embedded_broker", "mosquitto"])
def test_lockstep_mqtt_reproduces_inprocess_bit_for_bit(broker, request, tmp_path):
    url = request.getfixturevalue(broker)
    cfg = small_config(mqtt={"broker": url})
    local = simulate(cfg)
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert local.rounds > 0
    assert remote.rounds == local.rounds
    np.testing.assert_array_equal(remote.acc, local.acc)
    assert remote.global_sha256 == local.global_sha256


def test_q8_over_mqtt_reproduces_inprocess(embedded_broker, tmp_path):
    """uint8 codes and float32 ranges cross the codec and the daemon's validation intact."""
    cfg = small_config(mqtt={"broker": embedded_broker}, fed={"encoding": "q8"})
    local = simulate(cfg)
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert local.rounds > 0 and remote.rounds == local.rounds
    assert remote.global_sha256 == local.global_sha256
    assert remote.comm.bytes_up < 0.4 * simulate(small_config(mqtt={"broker": embedded_broker})
                                                 ).comm.bytes_up


def test_sparse_downlink_over_mqtt_reproduces_inprocess_and_sends_less(embedded_broker,
                                                                        tmp_path):
    cfg = small_config(mqtt={"broker": embedded_broker}, fed={"encoding": "sparse"})
    local = simulate(cfg)
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert remote.global_sha256 == local.global_sha256
    np.testing.assert_array_equal(remote.acc, local.acc)
    whole = len((tmp_path / "fleet" / "aggregator" / "global.npz").read_bytes())
    per_client_rounds = remote.rounds  # every device receives every change
    assert remote.comm.bytes_down < 0.8 * whole * per_client_rounds * cfg.fed.clients


def test_sparse_globals_over_mqtt_reproduce_inprocess_and_send_less(embedded_broker,
                                                                    tmp_path):
    """`--global-topk`: the daemon publishes each version's few changed entries as a delta,
    the devices follow them and end on the in-process run's global."""
    cfg = small_config(mqtt={"broker": embedded_broker}, fed={"global_topk": 0.05})
    local = simulate(cfg)
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert local.rounds > 0 and remote.global_sha256 == local.global_sha256
    np.testing.assert_array_equal(remote.acc, local.acc)
    whole = len((tmp_path / "fleet" / "aggregator" / "global.npz").read_bytes())
    assert remote.comm.bytes_down < 0.3 * whole * remote.rounds * cfg.fed.clients


def test_an_async_fleet_on_sparse_globals_learns_and_receives_less(embedded_broker, tmp_path):
    """`--global-topk` in async mode: the devices follow the deltas of every version (QoS 1)
    and fetch the whole global only when they miss one; they receive far less than whole
    globals, and the run learns (the tiny-fleet outcome near 0 is an expected failure, as in
    the pull test above)."""
    cfg = small_config(mqtt={"broker": embedded_broker},
                       fed={"mode": "async", "global_topk": 0.05, "min_clients": 1})
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert remote.rounds > 0
    whole = len((tmp_path / "fleet" / "aggregator" / "global.npz").read_bytes())
    for down in remote.comm.down.values():  # the retained whole once, then deltas
        assert 0 < down < whole * (2 + 0.3 * remote.rounds)
    final = remote.acc[:, -1, :]
    if final[:, -1].min() < 0.1:
        pytest.xfail(f"the last task ended near 0 ({final.tolist()}): tiny async tasks "
                     "on a slow link, docs/async.md")
    assert final.mean() > 0.5


@pytest.mark.mqtt
def test_another_devices_status_flood_never_reaches_the_replayer(mosquitto):
    """A roster device floods statuses of 16,000 numbers (300 a second): the replayer listens
    to its own clients' statuses only, so it decodes none of them and streams on (on status/+
    it decoded every one in its network thread, its publishes went unacknowledged for 30 s
    and a firmware_sim fleet run failed)."""
    import threading

    from edgefcl.data.types import Batch
    from edgefcl.runtime.replayer import Replayer
    from edgefcl.transport.codec import Message, encode
    from edgefcl.transport.mqtt import MqttLink

    cfg = small_config(mqtt={"broker": mosquitto, "fleet": "rp"})
    tp = topics(cfg.mqtt)
    batches = [Batch(np.zeros((4, 3), np.float32), np.zeros(4, np.int64), 0, i, i == 9)
               for i in range(10)]
    rep = Replayer(cfg, {"c0": iter(batches)}, rate=20.0, wait_online=10.0)
    seen: list[str] = []
    on_status = rep._on_status
    rep._on_status = lambda topic, payload: seen.append(topic) or on_status(topic, payload)
    flood = MqttLink(mosquitto, "byz", clean_start=True).connect()
    device = MqttLink(mosquitto, "c0", clean_start=True).connect()
    stop = threading.Event()
    big = encode(Message("status", {"state": "online", "pad": [7] * 16_000}, sender="byz"),
                 fleet="rp")

    def flooding() -> None:
        while not stop.wait(1 / 300):
            flood.publish(tp.status("byz"), big, qos=0)

    th = threading.Thread(target=flooding, daemon=True)
    th.start()
    device.publish(tp.status("c0"), encode(Message("status", {"state": "online"}, sender="c0"),
                                           fleet="rp"), retain=True, wait=True)
    try:
        sent = rep.run()
    finally:
        stop.set()
        th.join(5)
        flood.close()
        device.close()
    assert sent == {"c0": 10}
    assert seen and all(t == tp.status("c0") for t in seen)


@pytest.mark.parametrize("body", [{"state": "online", "consumed": "x"},
                                  {"state": "refused", "time": "soon"},
                                  {"state": "online", "consumed": [1]}])
def test_a_malformed_device_status_is_ignored_by_the_replayer(body):
    """A device's status is untrusted: a count or time of the wrong type changes nothing and
    raises nothing in the network thread."""
    from edgefcl.runtime.replayer import Replayer
    from edgefcl.transport.codec import Message

    cfg = small_config(mqtt={"fleet": "rp"})
    rep = Replayer(cfg, {"c0": iter([])})
    tp = topics(cfg.mqtt)
    rep._on_status(tp.status("c0"), encode(Message("status", body, sender="c0"), fleet="rp"))
    rep._on_aggregator_status(tp.aggregator_status, encode(Message("status", body, sender="agg"),
                                                         fleet="rp"))
    assert rep.consumed in ({}, {"c0": 0}) and not rep.refused and rep.aggregator_refused is None


def test_an_async_fleet_that_pulls_its_globals_learns(embedded_broker, tmp_path):
    """`--downlink pull`: each device listens for globals only while an update of its waits
    to be counted. The run completes and learns, and a device receives at most every global
    plus the retained one again for each update it sends (its subscription delivers it: on
    2 devices and 10 rounds pulling costs more than it saves; it pays at fleet scale, where
    rounds close faster than a device sends, see docs/studies/scaling.md).

    On a busy machine this tiny fleet's last task now and then ends near 0 on a device,
    with or without pull ("Tiny tasks on a slow link" in docs/async.md: the carried
    end-of-task updates and the merge by what a global counted made it rare, not
    impossible): that outcome is reported as an expected failure, so that it stays visible
    without failing the run; any other outcome must have learned."""
    cfg = small_config(mqtt={"broker": embedded_broker},
                       fed={"mode": "async", "downlink": "pull", "min_clients": 1})
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=tmp_path / "fleet")
    assert remote.rounds > 0 and remote.acc.shape == (cfg.fed.clients, cfg.data.tasks,
                                                       cfg.data.tasks)
    whole = len((tmp_path / "fleet" / "aggregator" / "global.npz").read_bytes())
    for c, down in remote.comm.down.items():  # an update weighs about a global here
        assert 0 < down <= 1.1 * (whole * (remote.rounds + 1) + remote.comm.up[c])
    final = remote.acc[:, -1, :]  # each device's accuracy on every task after the last one
    if final[:, -1].min() < 0.1:
        pytest.xfail(f"the last task ended near 0 ({final.tolist()}): tiny async tasks "
                     "on a slow link, docs/async.md")
    assert final.mean() > 0.5  # 4 classes in all: chance is 0.25


def test_a_chunk_bomb_on_a_status_topic_is_refused_by_its_structure(daemon):
    """A message with the chunk prefix and an "id" of 4 million empty arrays went to
    msgpack unscanned on the network thread, under the link's lock: the daemon stalled
    while it unpacked 285 MiB of objects, then counted it malformed."""
    from edgefcl.transport.chunks import _PREFIX

    d, cfg, _ = daemon
    n = 4_000_000
    rest = {"index": 0, "count": 1, "size": 1, "digest": b"0" * 32, "data": b"x"}
    bomb = (_PREFIX + msgpack.packb("id") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
            + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in rest.items()))
    link = open_link(cfg.mqtt, "attacker", clean_start=True)
    topic = topics(cfg.mqtt).status("dev")
    link.publish(topic, bomb, retain=True, wait=True)  # retained: sent whole, not split
    assert wait_for(lambda: d.agg.counters["rejected_limits"] == 1), dict(d.agg.counters)
    assert d.agg.counters["rejected_malformed"] == 0 and d.link.rejected == 1
    link.publish(topic, b"", retain=True, wait=True)
    link.close()


def test_one_devices_refusal_cannot_stop_the_others_streams(monkeypatch):
    """A reviewer helper's attack: one device's retained `refused` status, dated in the future,
    stopped every replay (then and in every later run) and wrote its reason, escapes and all,
    to the operator's terminal. A refusal now counts only when dated since the replayer
    started and not after now; a refusing client's stream is skipped, the others go on; and
    its reason is escaped and cut."""
    import edgefcl.runtime.replayer as rp
    from edgefcl.data.types import Batch
    from edgefcl.support.errors import UserError
    from edgefcl.transport.codec import Message

    cfg = small_config(mqtt={"fleet": "rp"})
    tp = topics(cfg.mqtt)
    now = time.time()
    reason = "\x1b[2J\x1b]0;owned\x07" + "A" * 100_000
    statuses = {tp.status(f"h{i}"): {"state": "online"} for i in range(3)}
    statuses[tp.status("x")] = {"state": "refused", "time": 1e12, "reason": reason}
    statuses[tp.status("y")] = {"state": "refused", "time": now, "reason": reason}
    sent: list[str] = []

    class Link:
        def subscribe(self, topic, handler):
            if topic in statuses:
                handler(topic, encode(Message("status", statuses[topic],
                                              sender=tp.client_from(topic)), fleet="rp"))

        def publish(self, topic, payload, **kw):
            sent.append(topic)
            return len(payload)

        def close(self):
            pass

    monkeypatch.setattr(rp, "open_link", lambda *a, **k: Link())
    batch = Batch(np.zeros((1, 2), np.float32), np.zeros(1, np.int64), 0, 0, False)
    clients = ["h0", "h1", "h2", "x", "y"]
    rep = rp.Replayer(cfg, {c: iter([batch] * 3) for c in clients}, wait_online=1.0)
    out = rep.run()
    assert out["h0"] == out["h1"] == out["h2"] == 3 and out["y"] == 0
    assert tp.stream("y") not in sent and "x" not in rep.refused  # x's time: the future
    assert set(rep.refused) == {"y"} and len(rep.refused["y"]) <= rp.MAX_REASON
    assert "\x1b" not in rep.refused["y"] and "\x07" not in rep.refused["y"]
    statuses = {tp.status("y"): statuses[tp.status("y")]}
    with pytest.raises(UserError, match="every client refused to join"):
        rp.Replayer(cfg, {"y": iter([batch])}, wait_online=1.0).run()


def test_an_error_said_on_the_terminal_is_escaped_and_cut():
    from edgefcl.options import MAX_ERROR_CHARS, one_line
    from edgefcl.support.errors import UserError

    line = one_line(UserError("client x refused: \x1b[2J\x1b]0;owned\x07" + "A" * 10_000))
    assert "\x1b" not in line and "\x07" not in line and len(line) == MAX_ERROR_CHARS
