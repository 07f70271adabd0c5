"""Attacks on the root's partial path and the worker's update path, driven through the daemons'
`handle` as the MQTT inbox delivers them: a partial is taken only from a configured worker on
its own topic, sealed, float64, finite, shaped like the model, with no negative weights."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.shard import Partial, ShardWorker
from edgefcl.federation.shard import state_bytes as shard_state_bytes
from edgefcl.runtime.links import NullLink, topics
from edgefcl.runtime.shard_root import RootDaemon
from edgefcl.runtime.shard_worker import WorkerDaemon
from edgefcl.transport.codec import Message, encode
from edgefcl.transport.partials import decode_grant, encode_claim, encode_grant, encode_partial

FLEET = "t"
INITIAL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}


def cfg_for(**fed) -> RunConfig:
    values = {"fed": {"clients": 4, "burn_in": 0, "jump": 1, "mode": "async",
                      "min_clients": 2, "round_timeout": 60.0, "clip_factor": 0.0,
                      "max_share": 1.0, **fed},
              "mqtt": {"fleet": FLEET, "max_payload": 1 << 20}, "quiet": True}
    return apply(RunConfig(), values)


def make_root(tmp_path, **fed) -> RootDaemon:
    d = RootDaemon(cfg_for(**fed), INITIAL, tmp_path / "state", workers=frozenset({"w0", "w1"}))
    d.link = NullLink()
    return d


def update(client: str, value: float, seq: int = 1, n: int = 4) -> Update:
    t = {k: np.full(v.shape, value, np.float32) for k, v in INITIAL.items()}
    return Update(client, 0, seq, 0, seq, n, t, class_counts={0: n})


def partial(worker="w0", clients=("a", "b"), **cfg) -> Partial:
    w = ShardWorker(INITIAL, cfg_for(**cfg).fed, worker=worker)
    for i, c in enumerate(clients):
        w.submit(update(c, float(i + 1)), 0.0)
    return w.flush()


def topic(worker="w0") -> str:
    return topics(cfg_for().mqtt).partial(worker)


def test_a_workers_counters_cannot_grow_the_roots_status(tmp_path):
    # the attack (one worker, or a bug in one): partials carrying 6,000 invented counter
    # names each grew the root's counters to 24,002, its status to 404 KB and past the
    # codec's limits, so devices never saw the aggregator online and `edgefcl status` lost it
    from edgefcl.transport.codec import decode

    d = make_root(tmp_path, clients=40)
    d.agg.worker_online("w0")
    d.agg.worker_online("w1")
    honest = partial("w1", ("h",))
    honest.counters = {"rejected_index-range": 1}  # a reason with a hyphen is a name
    d.handle(topic("w1"), encode_partial(honest, fleet=FLEET))
    for i in range(4):
        p = partial("w0", (f"c{i}",))
        p.counters = {**{f"junk_{i}_{j}\x1b[2J": 1 for j in range(6000)},
                      **{f"made_up_{i}_{j}": 1 for j in range(600)}, "clipped": 2}
        d.handle(topic("w0"), encode_partial(p, fleet=FLEET))
    assert d.agg.counters["clipped"] == 8 and d.agg.counters["partials"] == 5
    assert d.agg.counters["rejected_index-range"] == 1
    assert not any("\x1b" in k for k in d.agg.counters)
    assert len(d.agg.counters) <= 300
    status = encode(Message("status", d.status()), fleet=FLEET, sender="aggregator")
    decode(status, FLEET, require_digest=True)  # within the limits devices decode with
    d.store.close()


def test_partials_held_for_the_next_round_are_bounded_by_bytes(tmp_path):
    # the attack: partials naming a client already in the round wait for the next one, at
    # most 64, but of any size: padded with tensors named after the global's, 16 of 42 MiB
    # held 672 MiB for a 1 MiB model
    big = {"w": np.zeros((256, 256), np.float32)}  # budget: 64 float64 copies, 32 MiB
    cfg = apply(cfg_for(), {"mqtt": {"max_payload": 16 << 20}})
    d = RootDaemon(cfg, big, tmp_path / "state", workers=frozenset({"w0", "w1"}))
    d.link = NullLink()
    d.agg.worker_online("w0")
    d.agg.worker_online("w1")

    def big_partial() -> Partial:
        w = ShardWorker(big, cfg.fed, worker="w0")
        w.submit(Update("a", 0, 1, 0, 1, 4, {"w": np.ones((256, 256), np.float32)},
                        class_counts={0: 4}), 0.0)
        return w.flush()

    d.handle(topic("w0"), encode_partial(big_partial(), fleet=FLEET))
    d.handle(topic("w0"), encode_partial(big_partial(), fleet=FLEET))
    assert len(d.agg.deferred) == 1  # an honest one waits
    padded = big_partial()
    for j in range(20):  # 10 MiB of padding, each named after the global's tensor
        padded.state[f"pad{j}"] = {"w": np.zeros((256, 256), np.float64)}
    payload = encode_partial(padded, fleet=FLEET)
    for _ in range(16):
        d.handle(topic("w0"), payload)
    held = sum(shard_state_bytes(p.state) for p in d.agg.deferred)
    assert held <= 32 << 20 and d.agg.counters["rejected_partial_deferred_full"] >= 13
    d.store.close()


def test_two_partials_close_a_round_with_the_weighted_mean(tmp_path):
    d = make_root(tmp_path)
    d.agg.worker_online("w0")
    d.agg.worker_online("w1")
    d.handle(topic("w0"), encode_partial(partial("w0", ("a",)), fleet=FLEET))
    assert d.agg.global_.version == 0
    d.handle(topic("w1"), encode_partial(partial("w1", ("b", "c")), fleet=FLEET))
    assert d.agg.global_.version == 1
    # a: 1.0 (4 samples), b: 1.0, c: 2.0 -> mean 4/3, mixed 0.5 with zeros
    assert np.allclose(d.agg.global_.tensors["w"], 0.5 * 4 / 3)
    assert d.store.round_lines()[-1]["participants"] == ["a", "b", "c"]


def test_a_workers_partials_are_not_charged_to_a_devices_cpu_share(tmp_path):
    # a partial carries many devices' work: under the share of one device (`--sender-cpu`)
    # the root would refuse a busy worker's partials, and lose its devices' updates
    d = make_root(tmp_path, sender_cpu=1e-9)
    d.agg.worker_online("w0")
    d.agg.worker_online("w1")
    for _ in range(3):
        assert d.inbox.put(topic("w0"), encode_partial(partial("w0", ("a",)), fleet=FLEET))
        d.handle(*d.inbox.get(0.0))
    assert d.inbox.over_cpu == 0
    d.handle(d.topics.update("a"), b"junk")  # a device's own message is charged
    assert d.inbox.put(d.topics.update("a"), b"1") and d.inbox.put(d.topics.update("b"), b"2")
    assert d.inbox.get(0.0) == (d.topics.update("b"), b"2") and d.inbox.over_cpu == 1


def tamper(p: Partial, path: str, value) -> bytes:
    payload = msgpack.unpackb(encode_partial(p, fleet=FLEET), raw=False, strict_map_key=False)
    node = payload
    *levels, leaf = path.split(".")
    for level in levels:
        node = node[level]
    node[leaf] = value
    from edgefcl.transport import integrity

    payload.pop(integrity.DIGEST_KEY, None)
    return integrity.seal(payload, lambda m: msgpack.packb(m, use_bin_type=True))


def f64(shape, fill=1.0, dtype="<f8"):
    arr = np.full(shape, fill, np.dtype(dtype))
    return {"dtype": dtype, "shape": list(shape), "data": arr.tobytes()}


@pytest.mark.parametrize("path,value,reason", [
    ("tensors.sums/w", f64((2, 3), np.nan), "nonfinite"),
    ("tensors.sums/w", f64((3, 3)), "shape"),
    ("tensors.sums/w", f64((2, 3), dtype="<f4"), "dtype"),
    ("tensors.sums/zz", f64((2,)), "names"),
    ("scalars.weight", -5.0, "negative"),
    ("scalars.weight", float("inf"), "malformed"),
    ("participants", ["a", "a/b"], "malformed"),
    ("seqs", {"a": 1}, "malformed"),
    ("seqs", {"a": 1, "b": 0}, "malformed"),
    ("worker", "w1", "sender"),
    ("version", 7, None),  # decodes, then the root refuses a base from the future
])
def test_root_rejects_tampered_partials(tmp_path, path, value, reason):
    d = make_root(tmp_path)
    d.handle(topic("w0"), tamper(partial(), path, value))
    rejected = {k: v for k, v in d.agg.counters.items() if k.startswith("rejected")}
    assert rejected == ({f"rejected_{reason}": 1} if reason else {"rejected_partial_base": 1})
    assert not d.agg.in_round


def test_partials_only_from_configured_workers_on_their_own_topic(tmp_path):
    d = make_root(tmp_path)
    d.handle(topic("w9"), encode_partial(partial("w9"), fleet=FLEET))
    d.handle(topic("w1"), encode_partial(partial("w0"), fleet=FLEET))
    unsealed = msgpack.packb({"schema": 1, "kind": "partial", "fleet": FLEET, "sender": "w0"})
    d.handle(topic("w0"), unsealed)
    # a device's update on a partial topic, and a partial on a device's update topic
    d.handle(topic("w0"), encode(update("a", 1.0), fleet=FLEET))
    d.handle(topics(cfg_for().mqtt).update("a"), encode_partial(partial(), fleet=FLEET))
    c = d.agg.counters
    assert (c["rejected_worker"], c["rejected_sender"], c["rejected_digest"]) == (1, 1, 1)
    assert c["rejected_kind"] == 2
    assert not d.agg.in_round and d.agg.global_.version == 0


def test_worker_checks_updates_like_the_aggregator(tmp_path):
    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w0")
    w.agg = ShardWorker(INITIAL, cfg.fed, worker="w0")
    t = topics(cfg.mqtt)
    w.handle(t.update("a"), encode(update("a", 1.0), fleet=FLEET))
    w.handle(t.update("a"), encode(update("a", 1.0), fleet=FLEET))  # replayed
    w.handle(t.update("b"), encode(update("a", 1.0, seq=2), fleet=FLEET))  # not its topic
    w.handle(t.update("c"), encode(update("c", float("nan")), fleet=FLEET))
    w.handle(t.update("d"), b"\x93junk")
    c = w.agg.counters
    assert (c["accepted"], c["rejected_duplicate"], c["rejected_sender"]) == (1, 1, 1)
    assert c["rejected_nonfinite"] == 1 and c["rejected_malformed"] == 1
    # globals: only ones that match the model, newer than the held one
    w.handle(t.global_, encode(GlobalModel(3, {"w": np.zeros(3, np.float32)}), fleet=FLEET))
    assert c["rejected_global"] == 1 and w.agg.global_.version == 0
    w.handle(t.global_, encode(GlobalModel(3, INITIAL), fleet=FLEET))
    assert w.agg.global_.version == 3
    w.handle(t.global_, encode(Message("status", {"state": "online"}, sender="x"), fleet=FLEET))
    assert c["rejected_global"] == 2


def test_bench_shard_measures_every_cost_through_the_handlers():
    from edgefcl.bench.shard_cost import measure

    r = measure(INITIAL, {k: v + 1 for k, v in INITIAL.items()}, "dense", 6, 2, 2, RunConfig())
    assert r["rounds"] == 2 and r["workers"] == 2 and r["update_bytes"] > 0
    for k in ("cpu_ms_per_update_single", "cpu_ms_per_update_worker",
              "cpu_ms_per_partial_root"):
        assert r[k] > 0


class RecordingLink(NullLink):
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                wait: bool = False) -> int:
        self.sent.append((topic, payload))
        return len(payload)


def test_root_relays_its_most_loaded_workers_backpressure(tmp_path):
    from edgefcl.transport.codec import decode

    d = make_root(tmp_path, max_backpressure=8.0)
    d.link = RecordingLink()
    t = topics(d.cfg.mqtt)

    def status(worker: str, **body) -> None:
        d.handle(t.worker_status(worker), encode(Message("status", {"state": "online", **body},
                                                         sender=worker), fleet=FLEET))

    def config() -> dict:
        sent = [p for topic_, p in d.link.sent if topic_ == t.config]
        return decode(sent[-1], FLEET).body

    status("w0", backpressure=1.5, backpressure_reason="fill")
    status("w1", backpressure=3.0, backpressure_reason="shed")
    assert (config()["backpressure"], config()["backpressure_reason"]) == (3.0, "w1: shed")
    # a worker's factor is clamped to --max-backpressure, an unknown reason is dropped
    status("w0", backpressure=1e9, backpressure_reason="x" * 10_000)
    assert (config()["backpressure"], config()["backpressure_reason"]) == (8.0, "w0: ")
    status("w0", backpressure="fast")  # malformed: 1
    assert config()["backpressure"] == 3.0
    # a worker that goes offline no longer slows the fleet
    d.handle(t.worker_status("w1"), encode(Message("status", {"state": "offline"}, sender="w1"),
                                           fleet=FLEET))
    assert (config()["backpressure"], config()["backpressure_reason"]) == (1.0, "")
    # the root's own load (partials) never sets the factor
    published = len(d.link.sent)
    d._pressure()
    assert len(d.link.sent) == published and d.backpressure.factor == 1.0


def test_worker_status_carries_its_inbox_backpressure(tmp_path):
    cfg = cfg_for(max_backpressure=4.0)
    w = WorkerDaemon(cfg, "w0", inbox_bytes=100)
    w.agg = ShardWorker(INITIAL, cfg.fed, worker="w0")
    assert w.status()["backpressure"] == 1.0
    for k in range(3):
        w.inbox.put(f"t{k}", b"x" * 60)  # one queued, two shed: max(3 / 1, 3 / 1) -> 3
    w.inbox.get(0.1)
    w._pressure()
    assert (w.status()["backpressure"], w.status()["backpressure_reason"]) == (3.0, "shed")


def test_a_worker_holds_an_update_based_on_a_global_it_has_not_seen_yet(tmp_path):
    # the trap: with 2 workers, honest updates were rejected as `base` when a device saw the
    # root's newer global before its worker did
    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w0")
    w.agg = ShardWorker(INITIAL, cfg.fed, worker="w0")
    t = topics(cfg.mqtt)
    ahead = Update("a", 1, 1, 0, 1, 4, dict(INITIAL), class_counts={0: 4})
    w.handle(t.update("a"), encode(ahead, fleet=FLEET))
    far = Update("b", 9, 1, 0, 1, 4, dict(INITIAL), class_counts={0: 4})
    w.handle(t.update("b"), encode(far, fleet=FLEET))  # far ahead: a claim, refused
    c = w.agg.counters
    assert c["held_ahead"] == 1 and c["rejected_base"] == 1 and w.agg.pending() == 0
    w.handle(t.global_, encode(GlobalModel(1, INITIAL), fleet=FLEET))
    assert w.agg.pending() == 1 and c["accepted"] == 1 and not w.ahead


class _Recorder(NullLink):
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic, payload, qos=1, retain=False, wait=False) -> int:
        self.sent.append((topic, payload))
        return len(payload)


def test_the_root_answers_a_claim_on_the_workers_grant_topic(tmp_path):
    d = make_root(tmp_path)
    d.link = _Recorder()
    d.agg.worker_online("w0")
    d.handle(topic("w0"), encode_claim("w0", 7, ["a", "b"], fleet=FLEET))
    (where, payload), = [s for s in d.link.sent if "/grant/" in s[0]]
    assert where == topics(cfg_for().mqtt).grant("w0")
    assert decode_grant(payload, FLEET, cap=4) == (7, ["a", "b"])
    d.link.sent.clear()
    d.handle(topic("w1"), encode_claim("w1", 1, ["a", "c"], fleet=FLEET))
    assert decode_grant(d.link.sent[-1][1], FLEET, cap=4) == (1, ["c"])  # a: w0's


@pytest.mark.parametrize("body,reason", [
    ({"claim": 1, "clients": ["a", "a"]}, "malformed"),
    ({"claim": 1, "clients": ["a/b"]}, "malformed"),
    ({"claim": 1, "clients": [f"c{i}" for i in range(5)]}, "malformed"),  # over the roster cap
    ({"claim": -1, "clients": ["a"]}, "malformed"),
    ({"claim": 1.5, "clients": ["a"]}, "malformed"),
    ({"claim": 1, "clients": "a"}, "malformed"),
])
def test_the_root_rejects_malformed_claims(tmp_path, body, reason):
    d = make_root(tmp_path)
    d.link = _Recorder()
    d.handle(topic("w0"), encode(Message("claim", body), fleet=FLEET, sender="w0"))
    assert d.agg.counters[f"rejected_{reason}"] == 1
    assert d.link.sent == [] and d.agg.granted == {}


def test_a_claim_in_another_workers_name_is_rejected(tmp_path):
    d = make_root(tmp_path)
    d.link = _Recorder()
    d.handle(topic("w0"), encode_claim("w1", 1, ["a"], fleet=FLEET))
    assert d.agg.counters["rejected_sender"] == 1 and d.agg.granted == {}


def test_a_worker_folds_only_the_granted_clients_of_its_claim(tmp_path):
    w = WorkerDaemon(cfg_for(), "w0")
    w.agg = ShardWorker(INITIAL, cfg_for().fed, worker="w0")
    w.link = w.up = _Recorder()
    t = topics(cfg_for().mqtt)
    for c in ("a", "b"):
        w.handle(t.update(c), encode(update(c, 1.0), fleet=FLEET))
    w.claim(1.0)
    w._latest_grant = encode_grant(w.claims - 1, ["a"], fleet=FLEET, sender="aggregator")
    w._take_grant()  # an answer to an earlier claim: ignored
    assert w.partials_sent == 0
    w._latest_grant = encode_grant(w.claims, ["a"], fleet=FLEET, sender="aggregator")
    w._take_grant()
    assert w.partials_sent == 1 and w.agg.claimable() == ("b",)


def _root_status(body: dict, sender: str = "aggregator") -> bytes:
    return encode(Message("status", body, sender=sender), fleet=FLEET)


def test_a_worker_told_to_exit_when_done_stops_once_its_root_finished():
    """`--exit-when-done` on a worker: it stops when the root it saw online says it finished,
    not on a root that stops for a restart, nor on a retained "finished" of an earlier run."""
    w = WorkerDaemon(cfg_for(), "w0", exit_when_done=True)
    t = topics(cfg_for().mqtt)
    finished = _root_status({"state": "stopped", "finished": True})
    w._on_root_status(t.aggregator_status, finished)  # retained, from the run before
    assert not w.stop_event.is_set()
    w._on_root_status(t.aggregator_status, _root_status({"state": "online"}))
    w._on_root_status(t.aggregator_status, _root_status({"state": "stopped"}))  # a restart
    w._on_root_status(t.aggregator_status, b"\x00garbage")
    w._on_root_status(t.aggregator_status, _root_status({"state": "stopped", "finished": "yes"}))
    assert not w.stop_event.is_set()
    w._on_root_status(t.aggregator_status, finished)
    assert w.stop_event.is_set()
    stays = WorkerDaemon(cfg_for(), "w1")  # without the flag it runs until stopped
    stays._on_root_status(t.aggregator_status, _root_status({"state": "online"}))
    stays._on_root_status(t.aggregator_status, finished)
    assert not stays.stop_event.is_set()


def test_the_root_says_when_its_run_finished(tmp_path):
    root = make_root(tmp_path)
    root.link = _Recorder()
    root._publish_status("stopped", finished=True)
    root._publish_status("stopped")
    t = topics(root.cfg.mqtt)
    from edgefcl.transport.codec import decode

    bodies = [decode(p, FLEET).body for topic, p in root.link.sent
              if topic == t.aggregator_status]
    assert bodies[-2]["finished"] is True and "finished" not in bodies[-1]


def test_a_class_weighted_partial_of_many_tensors_and_classes_is_taken(tmp_path):
    # a reviewer helper's finding: the root scanned partials against the codec's defaults,
    # past which an honest class-weighted partial of a 100-tensor model with 19 classes went
    # (a per-class sum a tensor, 2,048 at most): every update in it was rejected, and the
    # round waited for its grants until round_timeout
    from edgefcl.federation.strategy import MAX_ROUND_CLASSES

    initial = {f"l{i}": np.zeros(8, np.float32) for i in range(100)}
    cfg = cfg_for(clients=8, aggregation="class-weighted")
    d = RootDaemon(cfg, initial, tmp_path / "s", workers=frozenset({"w0"}))
    d.link = NullLink()
    d.agg.worker_online("w0")

    def up(c: str, classes: list[int]) -> Update:
        return Update(c, 0, 1, 0, 1, 3 * len(classes),
                      {k: np.ones(8, np.float32) for k in initial},
                      class_counts=dict.fromkeys(classes, 3))

    w = ShardWorker(initial, cfg.fed, worker="w0", batch_size=10)
    for i in range(8):
        w.submit(up(f"h{i}", [3 * i + j for j in range(3)]), 0.0)  # 24 classes in all
    d.handle(topic("w0"), encode_partial(w.flush(d.agg.claim("w0", w.claimable())), fleet=FLEET))
    assert d.agg.counters["accepted"] == 8 and not d.agg.counters["rejected_limits"]
    assert d.agg.global_.version == 1  # every granted device in: the round closed
    assert MAX_ROUND_CLASSES >= 24
    d.store.close()


def test_a_rejected_partial_releases_its_workers_grants(tmp_path):
    # a partial the root rejects held the round for its grants until round_timeout (60 s)
    d = make_root(tmp_path)
    d.agg.worker_online("w0")
    for c in "abc":
        d.agg.join(c, 0.0)
    w = ShardWorker(INITIAL, d.cfg.fed, worker="w0")
    for i, c in enumerate("abc"):
        w.submit(update(c, float(i)), 0.0)
    p = w.flush(d.agg.claim("w0", w.claimable()))
    assert set(d.agg.granted) == set("abc")
    d.handle(topic("w0"), encode_partial(p, fleet=FLEET)[:-3])  # damaged on the way
    assert not d.agg.granted and d.agg.counters["grants_released"] == 3
    w.submit(update("a", 1.0, seq=2), 1.0)
    w.submit(update("b", 1.0, seq=2), 1.0)
    d.handle(topic("w0"), encode_partial(w.flush(d.agg.claim("w0", w.claimable())),
                                         fleet=FLEET))
    assert d.agg.global_.version == 1  # a and b: the quorum of 3, and no grant waits
    d.store.close()


def test_a_worker_whose_granted_updates_all_fail_says_so_with_an_empty_claim(tmp_path):
    """Updates granted but dropped at the flush sent nothing, and the root waited for their
    grants until round_timeout: the worker now answers with an empty claim."""
    from edgefcl.transport.codec import decode

    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w0")
    w.agg = ShardWorker(INITIAL, cfg.fed, worker="w0")
    sent: list[tuple[str, bytes]] = []
    w.up = type("Up", (), {"publish": lambda self, t, p, **k: sent.append((t, p)) or len(p)})()
    w.agg.flush = lambda granted, now=None: None  # every granted update failed at the flush
    w.flush(["a", "b"], 1.0)
    assert len(sent) == 1 and sent[0][0] == topics(cfg.mqtt).partial("w0")
    msg = decode(sent[0][1], FLEET)
    assert msg.kind == "claim" and msg.body["clients"] == []
    w.flush([], 2.0)  # nothing granted, nothing to say
    assert len(sent) == 1

    def broken(granted, now=None):
        raise RuntimeError("a bug reached by input")

    w.agg.flush = broken  # an internal error at the flush: the grant is answered too
    w.flush(["a"], 3.0)
    assert len(sent) == 2 and decode(sent[1][1], FLEET).body["clients"] == []
    assert w.agg.counters["rejected_internal"] == 1


def _worker_on(version: int, run: str = "run-1"):
    """A WorkerDaemon as `run` leaves it: serving the root's global `version` of run `run`."""
    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w0")
    w.agg = ShardWorker(INITIAL, cfg.fed, version, worker="w0")
    w.run_id = run
    return w, topics(cfg.mqtt)


def _config(run: str, **fields) -> bytes:
    body = {"mode": "async", "encoding": "dense", "aggregation": "fedavg",
            "wire_dtype": "float32", "run": run, **fields}
    return encode(Message("config", body, sender="aggregator"), fleet=FLEET)


def _global(version: int, run: str, value: float = 0.0) -> bytes:
    tensors = {k: np.full(v.shape, value, np.float32) for k, v in INITIAL.items()}
    return encode(GlobalModel(version, tensors, run=run), fleet=FLEET)


def test_a_worker_follows_the_roots_new_run_back_to_version_0():
    # an operator's finding: workers kept an earlier run's retained global (version 15), newer
    # by version than the fresh root's, and rejected every update of the new run as stale;
    # a global now names its run, and a worker starts over on a new run's global
    w, t = _worker_on(15)
    w.handle(t.update("a"), encode(update("a", 1.0, seq=1), fleet=FLEET))
    assert w.agg.counters["rejected_stale"] == 1  # based on 0, at version 15
    w._on_global(t.global_, _global(0, "run-2"))
    w._take_global()
    assert w.agg.global_.version == 0 and w.run_id == "run-2"
    w.handle(t.update("a"), encode(update("a", 1.0, seq=2), fleet=FLEET))
    assert w.agg.counters["accepted"] == 1 and not w.agg.counters["rejected_stale"]
    w._on_global(t.global_, _global(0, "run-2"))  # the same run again (a root resumed)
    w._take_global()
    assert w.agg.pending() == 1  # nothing started over
    w._on_global(t.global_, _global(0, "run-3", value=5.0))  # another run, the same version
    w._take_global()
    assert w.run_id == "run-3" and float(w.agg.global_.tensors["b"][0]) == 5.0


def test_a_worker_refuses_a_root_whose_aggregation_differs():
    w, t = _worker_on(0)
    w._on_config(t.config, _config("run-1", aggregation="class-weighted"))
    w._take_config()
    assert w.refusal is None  # an earlier run's retained config: that root is not online
    w.root_seen_online = True
    w._take_config()
    assert w.stop_event.is_set()
    assert "aggregation fedavg here, class-weighted at the aggregator" in w.refusal


def test_the_retained_status_of_another_runs_worker_is_no_rejection(tmp_path):
    # an operator's finding: a root started with other --worker-ids counted the retained
    # statuses of the last run's workers as rejections; a partial of theirs still counts
    d = make_root(tmp_path)
    status = encode(Message("status", {"state": "online"}, sender="w9"), fleet=FLEET)
    d.handle(topics(cfg_for().mqtt).worker_status("w9"), status)
    assert not any(k.startswith("rejected") for k in d.agg.counters)
    d.handle(topic("w9"), encode_partial(partial("w9"), fleet=FLEET))
    assert d.agg.counters["rejected_worker"] == 1
    d.store.close()


def test_a_worker_whose_claims_go_unanswered_says_so(caplog):
    # an operator's finding: a worker the root does not know (--worker-ids) took its share of
    # the updates and logged nothing while the root dropped all of its claims
    import logging

    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w1")
    w.agg = ShardWorker(INITIAL, cfg.fed, worker="w1")
    w.up = type("Up", (), {"publish": lambda self, t, p, **k: len(p)})()
    w.agg.submit(update("a", 1.0), 0.0)
    with caplog.at_level(logging.WARNING, logger="edgefcl.worker"):
        for now in range(0, 14, 2):
            w.claim(float(now))
    said = [r.getMessage() for r in caplog.records if "answered none" in r.getMessage()]
    assert len(said) == 1 and "is w1 in the root's --worker-ids?" in said[0]


def test_a_second_worker_on_the_same_id_is_said(caplog):
    # an operator's finding: two workers given one id knocked each other off the broker every
    # second, and nothing said why
    import logging

    cfg = cfg_for()
    w = WorkerDaemon(cfg, "w0")
    t = topics(cfg.mqtt)

    def status(inc: str) -> bytes:
        return encode(Message("status", {"state": "online", "incarnation": inc}, sender="w0"),
                      fleet=FLEET)

    with caplog.at_level(logging.ERROR, logger="edgefcl.worker"):
        w._on_own_status(t.worker_status("w0"), status("old"))  # the retained one, at start
        w._on_own_status(t.worker_status("w0"), status(w.incarnation))  # its own came back
        w._on_own_status(t.worker_status("w0"), status("other"))
        w._on_own_status(t.worker_status("w0"), status("other"))  # once a minute
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "another worker process runs with this id" in said[0]
