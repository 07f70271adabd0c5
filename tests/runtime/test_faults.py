"""Fault injection over a real broker: the fleet runs as separate processes (aggregator,
clients, replayer) in async mode while a client is killed, the broker restarts, or the
aggregator is killed with SIGKILL and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefcl.config import RunConfig, apply, dump_toml
from edgefcl.data.streams import count_batches
from edgefcl.data.workload import client_id, load_workload
from edgefcl.transport.broker import start_mosquitto

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]

CLIENTS = 3


class Fleet:
    """Aggregator, clients and replayer as `python -m edgefcl` processes."""

    def __init__(self, url: str, tmp: Path, rate: float = 6.0, **fed) -> None:
        cfg = apply(RunConfig(), {
            "data": {"tasks": 2, "classes_per_task": 2},
            "learn": {"memory_size": 40, "local_epochs": 1},
            # a killed client: the aggregator ends the run once nothing came for client_timeout
            "fed": {"clients": CLIENTS, "burn_in": 2, "jump": 2, "mode": "async",
                    "min_clients": 2, "round_timeout": 1.0, "max_staleness": 1000,
                    "client_timeout": 5.0} | fed,
            "mqtt": {"broker": url, "fleet": f"f{os.getpid()}"}})
        self.cfg = cfg
        self.tmp = tmp
        self.conf = tmp / "fleet.toml"
        self.conf.write_text(dump_toml(cfg))
        self.state = tmp / "state"
        self.results = tmp / "results"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.rate = rate
        self.procs: dict[str, subprocess.Popen] = {}
        work = load_workload(cfg, cfg.seed)
        self.batches = {client_id(k): sum(count_batches(work.tasks[k], cfg.data.batch_size))
                        for k in range(CLIENTS)}

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "edgefcl", "-v", *args, "--config",
                                  str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def start_aggregator(self) -> None:
        self.spawn("aggregator", "aggregator", "--state-dir", str(self.state),
                   "--exit-when-done")

    def start(self) -> None:
        self.start_aggregator()
        for k in range(CLIENTS):
            self.spawn(client_id(k), "client", "--index", str(k), "--results",
                       str(self.results))
        self.spawn("replayer", "replay", "--rate", str(self.rate))

    def agg_state(self) -> dict:
        try:
            return json.loads((self.state / "state.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_rounds(self, n: int, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.agg_state()
            if state.get("rounds", 0) >= n:
                return state
            time.sleep(0.1)
        raise AssertionError(f"fewer than {n} rounds within {timeout} s\n{self.tail()}")

    def wait(self, names: list[str], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                code = self.procs[name].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish\n{self.tail()}") from None
            assert code == 0, f"{name} exited with {code}\n{self.tail()}"

    def client_results(self, cid: str) -> dict:
        return json.loads((self.results / f"{cid}.json").read_text())

    def tail(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                         for f in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def fleet_factory(tmp_path):
    fleets: list[Fleet] = []

    def make(url: str, **kw) -> Fleet:
        f = Fleet(url, tmp_path / f"fleet{len(fleets)}", **kw)
        fleets.append(f)
        return f

    (tmp_path / "fleet0").mkdir()
    (tmp_path / "fleet1").mkdir()
    yield make
    for f in fleets:
        f.stop()


@pytest.mark.parametrize("broker", ["embedded_broker", "mosquitto"])
def test_killed_client_does_not_stall_async_rounds(broker, request, fleet_factory):
    fleet = fleet_factory(request.getfixturevalue(broker))
    fleet.start()
    at_kill = fleet.wait_rounds(1)["rounds"]
    fleet.procs["c002"].send_signal(signal.SIGKILL)
    fleet.wait(["c000", "c001", "replayer", "aggregator"])
    final = fleet.agg_state()
    assert final["rounds"] > at_kill
    for cid in ("c000", "c001"):
        r = fleet.client_results(cid)
        assert r["batches"] == fleet.batches[cid]  # whole stream, each batch once
        # its last update reached the aggregator (the logs say where it went when not)
        assert r["seq"] == final["last_seq"][cid], fleet.tail()


def test_broker_restart_mid_run(fleet_factory, tmp_path):
    conf_dir = tmp_path / "mosq"
    persist = f"persistence true\npersistence_location {conf_dir}/\n"
    broker = start_mosquitto(config_dir=conf_dir, allow_anonymous=True, extra_conf=persist)
    try:
        fleet = fleet_factory(broker.url)
        fleet.start()
        fleet.wait_rounds(1)
        broker.stop()
        time.sleep(1.0)
        broker = start_mosquitto(port=broker.port, config_dir=conf_dir, allow_anonymous=True,
                                 extra_conf=persist)
        fleet.wait(["c000", "c001", "c002", "replayer", "aggregator"])
        final = fleet.agg_state()
        for cid, n in fleet.batches.items():
            r = fleet.client_results(cid)
            assert r["batches"] == n
            assert r["link"]["reconnects"] >= 1
            assert r["seq"] == final["last_seq"][cid], fleet.tail()
    finally:
        broker.stop()


def test_aggregator_sigkill_and_resume(mosquitto, fleet_factory):
    fleet = fleet_factory(mosquitto)
    fleet.start()
    fleet.wait_rounds(2)
    fleet.procs["aggregator"].send_signal(signal.SIGKILL)
    fleet.procs["aggregator"].wait()
    saved = fleet.agg_state()
    time.sleep(1.0)  # clients keep training and publishing while it is down
    fleet.start_aggregator()
    fleet.wait(["c000", "c001", "c002", "replayer", "aggregator"])
    log = (fleet.logs / "aggregator.log").read_text()
    assert f"at version {saved['version']} " in log  # resumed where it was
    final = fleet.agg_state()
    assert final["version"] > saved["version"]
    for cid, n in fleet.batches.items():
        r = fleet.client_results(cid)
        assert r["batches"] == n
        assert r["seq"] == final["last_seq"][cid], fleet.tail()  # nothing sent to it was lost


def test_updates_lost_with_a_killed_aggregator_are_sent_again(mosquitto, fleet_factory):
    """The aggregator acknowledges an update (QoS 1) when it receives it and holds it in the
    open round until the round closes: a SIGKILL loses what it held. c000 streams alone, so no
    round reaches min_clients = 2 and everything it sent is held when the aggregator dies. At
    the end of its stream c000 waits for a global that counts its last update; it sees the
    aggregator go offline and come back, sends that update again, and the restarted aggregator
    counts it in a round with c001."""
    fleet = fleet_factory(mosquitto, round_timeout=20.0)
    fleet.start_aggregator()
    fleet.spawn("c000", "client", "--index", "0", "--source", "local", "--results",
                str(fleet.results))
    log = fleet.logs / "c000.log"
    deadline = time.monotonic() + 120
    while "end of stream" not in log.read_text():
        assert time.monotonic() < deadline, fleet.tail()
        assert fleet.procs["c000"].poll() is None, fleet.tail()
        time.sleep(0.1)
    time.sleep(1.0)  # its last update reaches the aggregator (loopback) and is held there
    fleet.procs["aggregator"].send_signal(signal.SIGKILL)
    fleet.procs["aggregator"].wait()
    assert "c000" not in fleet.agg_state().get("last_seq", {})  # no round counted it
    fleet.start_aggregator()
    fleet.spawn("c001", "client", "--index", "1", "--source", "local")
    fleet.wait(["c000"])
    fleet.procs["c001"].kill()  # its own last update has no second client to close a round
    fleet.procs["c001"].wait()
    fleet.wait(["aggregator"])
    r = fleet.client_results("c000")
    assert r["batches"] == fleet.batches["c000"]
    assert r["rounds"] >= 1
    assert r["seq"] == fleet.agg_state()["last_seq"]["c000"], fleet.tail()
