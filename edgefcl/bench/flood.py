"""`edgefcl bench flood`: the real `edgefcl aggregator` under chunk and tensor-count floods.

A Mosquitto on a free loopback port (the project's test configuration with the production
queue limits; the embedded broker when Mosquitto is not installed), the aggregator as its own
process, two honest devices that send an update whenever a new global comes out (and again
after 5 s without one, as a device whose update was lost would), and four
attacking devices with valid credentials. Phases:

- idle: the baseline;
- chunk flood: the attackers open transfers that declare the largest payload (`max_payload`)
  and send every chunk but the last, round-robin, until `flood_mib` MiB are offered;
- tensor-count flood: the attackers send updates of 1.5 million zero-size tensors (49 MiB,
  chunked and complete) until `flood_mib` MiB are offered;
- status flood: one attacker sends 300 statuses a second for 10 s, each 16 KB holding a list
  of 16,000 numbers (expensive to scan), as a roster device could.

The aggregator's resident memory (`/proc/<pid>/status` VmRSS, sampled every 50 ms) is reported
per phase with its peak (VmHWM), as are the rounds closed, the slowest honest round (from the
second honest update to the new global) and the aggregator's rejection counters; for the
status flood also the honest rounds per second against the idle phase, the highest
backpressure factor the aggregator advertised, and whom its status names as flooding.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np

from edgefcl.config import RunConfig
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.transport.chunks import CHUNK_OVERHEAD, DEFAULT_CHUNK_SIZE
from edgefcl.transport.codec import SCHEMA_VERSION, Message, decode, encode
from edgefcl.transport.topics import Topics

FLEET = "flood"
HONEST = ("h0", "h1")
ATTACKERS = ("a0", "a1", "a2", "a3")
SHAPES = {"w": (256, 256), "b": (256,)}
ROUND_TIMEOUT = 2.0
RESEND_S = 5.0  # an honest device sends again after this long without a new global
BAR_MIB = 256


def _rss(pid: int, field: str = "VmRSS") -> float:
    """A memory field of process `pid` (Linux /proc), MiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class _Sampler(threading.Thread):
    """Samples the aggregator's RSS every 50 ms; `peak()` since the last `reset()`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.max, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            r = _rss(self.pid)
            if r == r:
                self.max = max(self.max, r)

    def reset(self) -> float:
        peak, self.max = self.max, _rss(self.pid)
        return round(peak, 1)


class _Honest(threading.Thread):
    """Two honest devices: on every new global both send an update based on it; records how
    long each round took from the second update to the next global."""

    def __init__(self, links: dict, tp: Topics) -> None:
        super().__init__(daemon=True)
        self.links, self.tp = links, tp
        self.version = -1
        self.new = threading.Condition()
        self.rounds: list[tuple[float, float]] = []  # (closed at, seconds)
        self.stop = threading.Event()
        links[HONEST[0]].subscribe(tp.global_, self._on_global)

    def _on_global(self, topic: str, payload: bytes) -> None:
        g = decode(payload, FLEET)
        if isinstance(g, GlobalModel):
            with self.new:
                self.version = max(self.version, g.version)
                self.new.notify_all()

    def run(self) -> None:
        rng = np.random.default_rng(0)
        seq, first = 0, {}  # base version -> when its first update went out
        while not self.stop.is_set():
            with self.new:
                if not self.new.wait_for(lambda: self.version >= 0, 1):
                    continue
                base = self.version
            seq += 1
            sent = first.setdefault(base, time.monotonic())
            for cid in HONEST:
                t = {k: rng.normal(0, 0.01, s).astype(np.float32) for k, s in SHAPES.items()}
                self.links[cid].publish(self.tp.update(cid), encode(
                    Update(cid, base, seq, 0, seq, 8, t, class_counts={0: 8}), fleet=FLEET))
            with self.new:  # an update lost in a flood is sent again, as a device would
                self.new.wait_for(lambda b=base: self.version > b or self.stop.is_set(),
                                  RESEND_S)
            if self.version > base:
                self.rounds.append((time.monotonic(), time.monotonic() - sent))
                first.clear()


def _chunk(msg_id: str, index: int, count: int, size: int, digest: bytes, data: bytes) -> bytes:
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": "chunk", "id": msg_id,
                          "index": index, "count": count, "size": size, "digest": digest,
                          "data": data}, use_bin_type=True)


def _chunk_flood(links: dict, tp: Topics, mib: int, max_payload: int) -> int:
    """Transfers that declare `max_payload` bytes and never finish; returns bytes offered."""
    step = DEFAULT_CHUNK_SIZE - CHUNK_OVERHEAD
    count = math.ceil(max_payload / step)
    data = bytes(step)
    sent, n = 0, 0
    while sent < mib << 20:
        cid = ATTACKERS[n % len(ATTACKERS)]
        msg_id, digest = secrets.token_hex(8), secrets.token_bytes(32)
        for i in range(count - 1):
            last = i == count - 2 or sent + step >= mib << 20
            links[cid].publish(tp.update(cid), _chunk(msg_id, i, count, max_payload, digest, data),
                               wait=last, timeout=300)  # paced by the broker's acks
            sent += step
            if last:
                break
        n += 1
    return sent


def _tensor_flood(links: dict, tp: Topics, mib: int) -> int:
    """Updates of 1.5 million zero-size tensors (complete, chunked); returns bytes offered."""
    zero = np.zeros(0, np.float32)
    payload = encode(Update("a0", 0, 1, 0, 1, 1, {f"t{i}": zero for i in range(1_500_000)}),
                     fleet=FLEET)
    sent, n = 0, 0
    while sent < mib << 20:
        cid = ATTACKERS[n % len(ATTACKERS)]
        links[cid].publish(tp.update(cid), payload, wait=n % len(ATTACKERS) == 3, timeout=300)
        sent += len(payload)
        n += 1
    return sent


def _status_flood(links: dict, tp: Topics, seconds: float = 10.0, rate: float = 300.0) -> int:
    """One attacker's statuses at `rate` a second for `seconds`; bytes offered."""
    cid = ATTACKERS[0]
    payload = encode(Message("status", {"state": "online", "pad": [7] * 16_000}, sender=cid),
                     fleet=FLEET)
    sent, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        links[cid].publish(tp.status(cid), payload, qos=0)
        sent += len(payload)
        time.sleep(max(0.0, start + sent / len(payload) / rate - now))
    return sent


def bench_flood(cfg: RunConfig, out: Path, count: int) -> dict:
    """`edgefcl bench flood`: `count` MiB offered per flood (default 1024)."""
    from edgefcl.runtime.links import payload_limit
    from edgefcl.support.statefiles import save_tensors
    from edgefcl.transport.broker import EmbeddedBroker, start_mosquitto
    from edgefcl.transport.mqtt import MqttLink

    mib = count or 1024
    work = out / "flood"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    initial = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    save_tensors(work / "init.npz", initial)
    limit = payload_limit(cfg, initial)  # what the aggregator will accept (0: from the model)
    if shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists():
        broker = start_mosquitto(config_dir=work / "mosquitto", allow_anonymous=True,
                                 extra_conf="max_queued_bytes 268435456\n")
        url, kind, stop_broker = broker.url, "mosquitto", broker.stop
    else:
        emb = EmbeddedBroker().__enter__()
        url, kind, stop_broker = emb.url, "embedded", lambda: emb.__exit__(None, None, None)
    tp = Topics(FLEET)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "edgefcl", "aggregator", "--broker", url, "--fleet", FLEET,
           "--initial", str(work / "init.npz"), "--state-dir", str(work / "state"),
           "--mode", "async", "--clients", "2", "--min-clients", "2", "--round-timeout",
           str(ROUND_TIMEOUT), "--burn-in", "0", "--jump", "1", "--max-payload",
           str(cfg.mqtt.max_payload), "-q"]
    log = open(work / "aggregator.log", "wb")  # noqa: SIM115
    agg = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    links: dict[str, MqttLink] = {}
    status: list[dict] = []
    report: dict = {"broker": kind, "flood_mib": mib, "bar_mib": BAR_MIB,
                    "max_payload": limit, "max_payload_option": cfg.mqtt.max_payload,
                    "phases": {}}
    try:
        for cid in (*HONEST, *ATTACKERS):
            links[cid] = MqttLink(url, cid).connect(10)
        links[HONEST[1]].subscribe(tp.aggregator_status, lambda t, p: status.append(
            decode(p, FLEET).body))
        for cid in HONEST:
            links[cid].publish(tp.status(cid), encode(Message(
                "status", {"state": "online", "incarnation": cid}, sender=cid), fleet=FLEET),
                retain=True, wait=True)
        honest = _Honest(links, tp)
        honest.start()
        t_wait = time.monotonic()
        while not honest.rounds and time.monotonic() - t_wait < 120:
            if agg.poll() is not None:
                tail = (work / "aggregator.log").read_text()[-500:]
                raise RuntimeError(f"the aggregator exited: {tail}")
            time.sleep(0.2)
        sampler = _Sampler(agg.pid)
        sampler.start()
        report["rss_start_mib"] = round(_rss(agg.pid), 1)
        print(f"aggregator up (pid {agg.pid}, RSS {report['rss_start_mib']} MiB, {kind} on "
              f"{url}); {mib} MiB per flood", flush=True)
        phases = (("idle", lambda: time.sleep(5) or 0),
                  ("chunk flood", lambda: _chunk_flood(links, tp, mib, limit)),
                  ("settle", lambda: time.sleep(5) or 0),
                  ("tensor-count flood", lambda: _tensor_flood(links, tp, mib)),
                  ("settle after", lambda: time.sleep(5) or 0),
                  ("status flood", lambda: _status_flood(links, tp)),
                  ("settle at last", lambda: time.sleep(5) or 0))
        sampler.reset()
        for name, run in phases:
            t0 = time.monotonic()
            before, seen = len(honest.rounds), len(status)
            offered = run()
            wall = time.monotonic() - t0
            rounds = [s for _, s in honest.rounds[before:]]
            during = status[seen:]
            phase = {"offered_mib": round(offered / 2**20, 1), "wall_s": round(wall, 1),
                     "rss_peak_mib": sampler.reset(), "rss_end_mib": round(_rss(agg.pid), 1),
                     "honest_rounds": len(rounds),
                     "honest_rounds_per_s": round(len(rounds) / wall, 2),
                     "slowest_honest_round_s": round(max(rounds), 2) if rounds else None,
                     "max_backpressure": max((b.get("backpressure", 1.0) for b in during),
                                             default=1.0),
                     "flooding": during[-1].get("flooding", {}) if during else {},
                     "aggregator_alive": agg.poll() is None}
            report["phases"][name] = phase
            slowest = phase["slowest_honest_round_s"]
            print(f"{name:>18}: offered {phase['offered_mib']:7.1f} MiB in {wall:5.1f} s; "
                  f"aggregator RSS peak {phase['rss_peak_mib']} MiB; {len(rounds)} honest rounds"
                  + ("" if slowest is None else f", slowest {slowest} s"), flush=True)
        time.sleep(2.5)  # one more aggregator status with the final counters
        report["rss_hwm_mib"] = round(_rss(agg.pid, "VmHWM"), 1)
        report["counters"] = status[-1].get("counters", {}) if status else {}
        honest.stop.set()
        sampler.stop.set()
    finally:
        for link in links.values():
            link.close()
        agg.terminate()
        try:
            agg.wait(20)
        except subprocess.TimeoutExpired:
            agg.kill()
        log.close()
        stop_broker()
    peak = max(p["rss_peak_mib"] for p in report["phases"].values())
    report["rss_peak_mib"] = peak
    print(f"\naggregator RSS: start {report['rss_start_mib']} MiB, peak under the floods "
          f"{peak} MiB, lifetime peak (VmHWM) {report['rss_hwm_mib']} MiB (bar {BAR_MIB} MiB: "
          f"{'met' if report['rss_hwm_mib'] < BAR_MIB else 'MISSED'})")
    print("rejections: " + json.dumps({k: v for k, v in report["counters"].items()
                                       if k.startswith("rejected")}))
    idle, flood = report["phases"]["idle"], report["phases"]["status flood"]
    kept = flood["honest_rounds_per_s"] / max(idle["honest_rounds_per_s"], 1e-9)
    report["status_flood"] = {"honest_rounds_kept": round(kept, 3),
                              "max_backpressure": flood["max_backpressure"],
                              "named": flood["flooding"]}
    print(f"status flood: honest rounds {flood['honest_rounds_per_s']}/s against "
          f"{idle['honest_rounds_per_s']}/s idle ({100 * kept:.0f} %), backpressure up to "
          f"{flood['max_backpressure']}, status names {flood['flooding'] or 'nobody'}")
    return report
