"""Sharded aggregation over a real Mosquitto: a root and two workers sharing the device updates
through an MQTT 5 shared subscription give the single-aggregator global; a worker killed
mid-run costs no device more than one round (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.q8 import Q8Encoder
from edgefcl.federation.sparse import SparseEncoder
from edgefcl.runtime.links import topics
from edgefcl.runtime.shard_root import RootDaemon
from edgefcl.runtime.shard_worker import WorkerDaemon
from edgefcl.transport.codec import decode, encode
from edgefcl.transport.mqtt import MqttLink

FLEET = "test"
N = 8
INITIAL = {"w": np.linspace(-1, 1, 60, dtype=np.float32).reshape(10, 6),
           "b": np.zeros(10, np.float32)}


def cfg_for(url: str, **fed) -> RunConfig:
    values = {"fed": {"clients": N, "burn_in": 0, "jump": 1, "mode": "async",
                      "min_clients": N, "round_timeout": 20.0, "clip_factor": 0.0,
                      "max_share": 1.0, "topk": 0.3, "value_dtype": "float32", "sample_cap": 1000,
                      **fed},
              "mqtt": {"fleet": FLEET, "broker": url}, "quiet": True}
    return apply(RunConfig(), values)


def device_updates(encoding: str, rng, seq: int = 1, version: int = 0, base=None):
    base = INITIAL if base is None else base
    out = []
    for i in range(N):
        t = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in base.items()}
        if encoding == "sparse":
            t = SparseEncoder(topk=0.3, value_dtype="float32").encode(t, base)
        if encoding == "q8":
            t = Q8Encoder().encode(t, base)
        n = int(rng.integers(2, 30))
        out.append(Update(f"d{i:02d}", version, seq, 0, seq, n, t, encoding,
                          {i % 3: n // 2 + 1, 3: n - n // 2 - 1} if n > 2 else {0: n}))
    return out


class Watcher:
    """Records every global the root publishes."""

    def __init__(self, url: str) -> None:
        self.globals: dict[int, GlobalModel] = {}
        self.link = MqttLink(url, "watcher", clean_start=True)
        self.link.subscribe(topics(cfg_for(url).mqtt).global_, self._on)
        self.link.connect()

    def _on(self, topic: str, payload: bytes) -> None:
        g = decode(payload)
        self.globals[g.version] = g

    def wait(self, version: int, timeout: float = 30.0) -> GlobalModel:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if version in self.globals:
                return self.globals[version]
            time.sleep(0.05)
        raise AssertionError(f"no global {version} within {timeout} s; have {sorted(self.globals)}")


def start(daemon) -> threading.Thread:
    th = threading.Thread(target=daemon.run, daemon=True)
    th.start()
    return th


def start_tier(cfg: RunConfig, url: str, state: Path, flush_every: float):
    """A root and workers w0, w1 in threads, both live at the root; (root, workers, threads,
    a watcher of the globals)."""
    root = RootDaemon(cfg, INITIAL, state, workers=frozenset({"w0", "w1"}))
    threads = [start(root)]
    watcher = Watcher(url)
    watcher.wait(0)
    workers = [WorkerDaemon(cfg, w, flush_every=flush_every) for w in ("w0", "w1")]
    threads += [start(w) for w in workers]
    deadline = time.monotonic() + 20
    while root.agg.live_workers != {"w0", "w1"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert root.agg.live_workers == {"w0", "w1"}
    return root, workers, threads, watcher


def stop_tier(daemons: list, threads: list[threading.Thread], dev: MqttLink,
              watcher: Watcher) -> None:
    """Stop what `start_tier` started, and the test's device link."""
    for d in daemons:
        d.stop_event.set()
    for th in threads:
        th.join(10)
    dev.close()
    watcher.link.close()


@pytest.mark.parametrize("encoding,aggregation", [("dense", "fedavg"),
                                                  ("dense", "class-weighted"),
                                                  ("sparse", "fedavg"),
                                                  ("q8", "class-weighted")])
def test_root_and_two_workers_over_mosquitto_equal_one_aggregator(mosquitto, tmp_path,
                                                                  encoding, aggregation):
    cfg = cfg_for(mosquitto, encoding=encoding, aggregation=aggregation)
    root, workers, threads, watcher = start_tier(cfg, mosquitto, tmp_path / "state", 1.0)
    updates = device_updates(encoding, np.random.default_rng(11))
    dev = MqttLink(mosquitto, "devices", clean_start=True).connect()
    t = topics(cfg.mqtt)
    for u in updates:
        dev.publish(t.update(u.client), encode(u, fleet=FLEET), wait=True)
    got = watcher.wait(1)
    single = Aggregator(INITIAL, cfg.fed, batch_size=cfg.data.batch_size)
    closed = None
    for u in updates:
        closed = single.submit(u, 0.0) or closed
    assert closed is not None
    assert got.participants == tuple(sorted(u.client for u in updates))
    for k, v in closed.global_.tensors.items():
        np.testing.assert_allclose(got.tensors[k], v, rtol=1e-6, atol=1e-7)
    # both workers took a share (Mosquitto hands shared messages out in turn)
    assert all(w.partials_sent >= 1 for w in workers)
    stop_tier([root, *workers], threads, dev, watcher)


def _cli(*args: str, log: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-m", "edgefcl", "aggregator", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_killing_one_of_two_workers_costs_a_device_at_most_one_round(mosquitto, tmp_path):
    """Eight devices send an update every 0.4 s; rounds close on 4 devices + 1.5 s timeout;
    workers flush every 0.5 s, longer than a device's period, so that each flush holds an
    update of every device of its share (with 0.3 s, under a loaded machine's timing a
    round could close on four devices whose updates happened to be in, twice in a row
    without one of the others, kill or no kill). Worker w1 is SIGKILLed after round 4:
    every device is in one of any two consecutive rounds from then on."""
    common = ["--broker", mosquitto, "--fleet", FLEET, "--mode", "async", "--clients", str(N),
              "--burn-in", "0", "--jump", "1", "--clip-factor", "0", "--max-share", "1",
              "--sample-cap", "1000"]
    cfg = cfg_for(mosquitto)
    np.savez(tmp_path / "initial.npz", **INITIAL)
    root = _cli("--role", "root", "--worker-ids", "w0,w1", "--state-dir", str(tmp_path / "s"),
                "--initial", str(tmp_path / "initial.npz"), "--min-clients", "4",
                "--round-timeout", "1.5", *common, log=tmp_path / "root.log")
    watcher = Watcher(mosquitto)
    procs = [root]
    try:
        watcher.wait(0, 60)
        for w in ("w0", "w1"):
            procs.append(_cli("--role", "worker", "--id", w, "--flush-every", "0.5", *common,
                              log=tmp_path / f"{w}.log"))
        time.sleep(3.0)
        dev = MqttLink(mosquitto, "devices", clean_start=True).connect()
        t = topics(cfg.mqtt)
        rng = np.random.default_rng(0)
        seq, killed_at = 0, None
        end = time.monotonic() + 60
        while time.monotonic() < end:
            seq += 1
            version = max(watcher.globals)
            for u in device_updates("dense", rng, seq, version, watcher.globals[version].tensors):
                dev.publish(t.update(u.client), encode(u, fleet=FLEET))
            if killed_at is None and version >= 4:
                procs[2].send_signal(signal.SIGKILL)
                killed_at = version
            if killed_at is not None and version >= killed_at + 10:
                break
            time.sleep(0.4)
        dev.close()
        assert killed_at is not None, "never reached round 4"
        last = max(watcher.globals)
        assert last >= killed_at + 10, f"only {last - killed_at} rounds after the kill"
        rounds = [set(watcher.globals[v].participants) for v in range(killed_at + 1, last + 1)]
        for d in (f"d{i:02d}" for i in range(N)):
            for a, b in zip(rounds, rounds[1:], strict=False):
                assert d in a | b, f"{d} missed two rounds in a row after the kill"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        watcher.link.close()


@pytest.mark.slow
def test_one_flooding_device_costs_honest_devices_under_5_percent_when_sharded(mosquitto,
                                                                              tmp_path):
    """A root, two workers, four honest devices at 1 update/s and one roster device sending
    valid updates at 20/s: at least 95 % of the honest updates are counted in a round (before,
    a partial that named the flooding device a second time in a round was held back whole,
    honest updates inside it included, and 54 of 160 were counted)."""
    honest = [f"d{i:02d}" for i in range(4)]
    attacker = "d07"
    cfg = cfg_for(mosquitto, min_clients=2, round_timeout=2.0)
    root, workers, threads, watcher = start_tier(cfg, mosquitto, tmp_path / "state", 0.5)
    dev = MqttLink(mosquitto, "devices", clean_start=True).connect()
    t = topics(cfg.mqtt)
    rng = np.random.default_rng(3)
    sent: set[tuple[str, int]] = set()

    def update(client: str, seq: int) -> bytes:
        version = max(watcher.globals)
        base = watcher.globals[version].tensors
        tensors = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32)
                   for k, v in base.items()}
        return encode(Update(client, version, seq, 0, seq, 8, tensors, "dense", {0: 8}),
                      fleet=FLEET)

    start_at = time.monotonic()
    for tick in range(20 * 20):  # 20 s in steps of 50 ms
        dev.publish(t.update(attacker), update(attacker, tick + 1))
        if tick % 20 == 0:
            for c in honest:
                seq = tick // 20 + 1
                dev.publish(t.update(c), update(c, seq))
                sent.add((c, seq))
        time.sleep(max(0.0, start_at + (tick + 1) * 0.05 - time.monotonic()))
    time.sleep(3.0)  # the last honest updates reach a round
    lines = root.store.round_lines()
    stop_tier([root, *workers], threads, dev, watcher)
    counted = {(c, s) for line in lines for c, s in line["seqs"].items()} & sent
    attacker_rounds = sum(attacker in line["seqs"] for line in lines)
    assert len(sent) == 80
    assert len(counted) >= 0.95 * len(sent), (
        f"{len(counted)} of {len(sent)} honest updates counted in {len(lines)} rounds "
        f"(the flooding device in {attacker_rounds}); root counters "
        f"{dict(root.agg.counters)}")
    assert all(sum(c == attacker for c in line["participants"]) <= 1 for line in lines)


def test_a_worker_told_to_exit_when_done_stops_when_its_root_finished(mosquitto, tmp_path):
    """Over Mosquitto: a worker started with --exit-when-done follows the root's retained
    status and stops once the root says its run finished (the root's last status when it
    exits with --exit-when-done), so a scripted fleet's `wait` ends."""
    cfg = cfg_for(mosquitto)
    root = RootDaemon(cfg, INITIAL, tmp_path / "state", workers=frozenset({"w0"}))
    threads = [start(root)]
    watcher = Watcher(mosquitto)
    watcher.wait(0)
    worker = WorkerDaemon(cfg, "w0", exit_when_done=True)
    threads.append(start(worker))
    deadline = time.monotonic() + 20
    while root.agg.live_workers != {"w0"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert root.agg.live_workers == {"w0"} and threads[1].is_alive()
    root._publish_status("stopped", finished=True)
    threads[1].join(15)
    assert not threads[1].is_alive()
    root.stop_event.set()
    threads[0].join(10)
    watcher.link.close()
