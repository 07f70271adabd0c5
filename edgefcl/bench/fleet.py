"""`edgefcl bench fleet`: how many devices one aggregator serves.

For each device count N, against a Mosquitto started from `broker/` on a free loopback port:
1. raw broker: N lightweight devices (`edgefcl.bench.loadgen.devices`, one MQTT connection
   each, many per process) publish pre-made valid updates at `--rate` per device to a plain
   subscriber that only counts them (`edgefcl.bench.loadgen.counter`);
2. aggregator: the same devices and payloads to the real `edgefcl aggregator` daemon (its own
   process, async mode), which validates and folds them.
Each phase is measured over `--duration` seconds after a warm-up. Writes DIR/bench_fleet.json,
prints a table and plots updates/s and round-interval p99 against N (DIR/bench_fleet.png).

`--overload X` measures overload instead (`run_overload`): the capacity of one aggregator, then
X times it offered with backpressure on and off.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from edgefcl.bench.loadgen.counter import run_counter
from edgefcl.bench.loadgen.devices import (
    COUNTERS,
    DeviceSpec,
    device_id,
    ignores,
    raise_fd_limit,
    run_devices,
)
from edgefcl.bench.loadgen.fleet_options import FleetOptions
from edgefcl.bench.loadgen.pacing import PACINGS, loaded, loaded_seconds
from edgefcl.config import ConfigError, RunConfig, dump_toml
from edgefcl.federation.versions import delta_downlink

DRAIN_S = 2.0


# -- payloads -------------------------------------------------------------------------------
def demo_tensors(cfg: RunConfig) -> dict[str, np.ndarray]:
    """The initial global of the configured model and dataset (the demo's small CNN)."""
    from edgefcl.build import initial_global, prepare

    return initial_global(cfg, prepare(cfg, cfg.seed))


def update_tensors(initial: dict[str, np.ndarray], payload: str, cfg: RunConfig,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """A valid update: the global plus noise, encoded as a client of encoding `payload` (dense
    or sparse) sends it."""
    from edgefcl.federation.registry import get_encoding

    rng = np.random.default_rng(seed)
    moved = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in
             initial.items()}
    return get_encoding(payload).make_encoder(cfg.fed).encode(moved, initial)


# -- measuring helpers ----------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """Resident memory (or its peak, key VmHWM) of a process in MB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


class StatusWatcher:
    """Follows the aggregator's retained status: (arrival time, status body) pairs, and the
    latest status of each worker (`workers_topic`, a wildcard) by topic."""

    def __init__(self, host: str, port: int, topic: str, workers_topic: str = "") -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.seen: list[tuple[float, dict]] = []
        self.workers: dict[str, dict] = {}
        self.topic = topic
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-status",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(topic, 0)] + ([(workers_topic, 0)] if workers_topic else []))
        self.client.on_message = self._on_message
        self.client.connect(host, port, keepalive=60)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        try:
            body = msgpack.unpackb(msg.payload, raw=False)
        except Exception:  # noqa: BLE001  (not ours to judge; the bench only reads counters)
            return
        if not isinstance(body, dict) or body.get("kind") != "status":
            return
        if msg.topic == self.topic:
            self.seen.append((time.monotonic(), body))
        elif body.get("state") == "online":  # a worker's last word before it stops has no
            self.workers[msg.topic] = body  # counters

    def online(self) -> bool:
        return any(b.get("state") == "online" for _, b in self.seen)

    def busy(self, t0: float, t1: float) -> float | None:
        """The aggregator's mean main-loop busy share over its statuses inside [t0, t1]."""
        shares = [b["busy"] for t, b in self.seen
                  if t0 <= t <= t1 and isinstance(b.get("busy"), (int, float))]
        return float(np.mean(shares)) if shares else None

    def accepted_rate(self, t0: float, t1: float) -> tuple[float, dict]:
        """Accepted updates per second between the first and last status inside [t0, t1]."""
        inside = [(t, b) for t, b in self.seen if t0 <= t <= t1 and b.get("state") == "online"]
        if len(inside) < 2:
            return 0.0, inside[-1][1] if inside else {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        acc = lambda s: s.get("counters", {}).get("accepted", 0)  # noqa: E731
        return (acc(b) - acc(a)) / (tb - ta), b

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


# -- one run --------------------------------------------------------------------------------
@dataclass
class Fleet:
    """Device processes and their shared counters."""

    ctx: mp.context.BaseContext
    rate: object = None
    """Updates/s per device (a shared float the device processes read)."""
    pacing: object = None
    """How the devices' updates fall due from when `go` is set (a shared index into
    PACINGS)."""
    procs: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)

    def total(self, name: str) -> int:
        return sum(c[name].value for c in self.counters.values())

    def factor(self) -> float:
        """The highest backpressure factor a device process follows now."""
        return max((c["factor_pct"].value for c in self.counters.values()), default=100) / 100


def start_fleet(ctx, opts: FleetOptions, n: int, host: str, port: int, fleet: str, root: str,
                encoding: str, tensors: dict, go, stop, burn_in: int = 4, jump: int = 2,
                max_backpressure: float = 8.0, deltas: bool = False) -> Fleet:
    f = Fleet(ctx, ctx.Value("d", opts.rate), ctx.Value("i", PACINGS.index("random")))
    procs = opts.procs(n)
    bounds = np.linspace(0, n, procs + 1).astype(int)
    for j in range(procs):
        spec = DeviceSpec(host, port, fleet, root, int(bounds[j]), int(bounds[j + 1] - bounds[j]),
                          opts.rate, encoding, tensors, seed=j, burn_in=burn_in, jump=jump,
                          max_backpressure=max_backpressure, ignoring=opts.ignoring,
                          globals=opts.globals, deltas=deltas)
        counters = {name: ctx.Value("q", 0) for name in COUNTERS}
        p = ctx.Process(target=run_devices, args=(spec, counters, go, stop, f.rate,
                                                  f.pacing), daemon=True,
                        name=f"devices-{j}")
        p.start()
        f.procs.append(p)
        f.counters[j] = counters
    return f


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise ConfigError(f"bench fleet: timed out waiting for {what}")
        time.sleep(0.1)


def measure_window(opts: FleetOptions, fleet: Fleet, go, sample=None) -> tuple[float, float,
                                                                                float]:
    """Publish for warm-up + duration; returns (t0, t1, published/s in the window)."""
    go.set()
    time.sleep(opts.warmup)
    t0, p0 = time.monotonic(), fleet.total("published")
    while time.monotonic() - t0 < opts.duration:
        if sample is not None:
            sample()
        time.sleep(0.5)
    t1, p1 = time.monotonic(), fleet.total("published")
    go.clear()
    return t0, t1, (p1 - p0) / (t1 - t0)


def raw_phase(ctx, opts: FleetOptions, broker, pattern: str, go) -> dict:
    """The rate at which the broker delivers the fleet's updates to a subscriber that only
    counts them (its own process, like the daemon)."""
    count, ready, stop = ctx.Value("q", 0, lock=False), ctx.Event(), ctx.Event()
    counter = ctx.Process(target=run_counter, daemon=True,
                          args=(broker.host, broker.port, pattern, count, ready, stop))
    counter.start()
    try:
        wait_until(ready.is_set, 30, "the counting subscriber")
        go.set()
        time.sleep(opts.warmup)
        t0, c0, b0 = time.monotonic(), count.value, cpu_seconds(broker.pid)
        time.sleep(opts.duration)
        t1, c1, b1 = time.monotonic(), count.value, cpu_seconds(broker.pid)
        go.clear()
        time.sleep(DRAIN_S)
    finally:
        stop.set()
        counter.join(10)
        if counter.is_alive():
            counter.terminate()
    return {"raw_broker_updates_per_s": (c1 - c0) / (t1 - t0), "raw_broker_cpu_s": b1 - b0}


def start_daemon(cmd: list[str], log_path: Path, watcher: StatusWatcher) -> subprocess.Popen:
    """Start `edgefcl aggregator` and wait for its first status; one clear error if it exits."""
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def up() -> bool:
        if daemon.poll() is not None:
            lines = log_path.read_text().strip().splitlines()
            raise ConfigError(f"bench fleet: the aggregator exited with {daemon.returncode}: "
                              f"{lines[-1] if lines else 'no output'}")
        return watcher.online()

    try:
        wait_until(up, 60, "the aggregator daemon")
    except BaseException:
        daemon.kill()
        raise
    return daemon


def stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.terminate()
    try:
        daemon.wait(20)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(10)


def daemon_commands(opts: FleetOptions, base: list[str], state: Path) -> list[tuple[str,
                                                                                  list[str]]]:
    """(name, command) of the aggregator tier: one `edgefcl aggregator`, or with W > 1 workers
    a root and W workers sharing the updates (MQTT 5 shared subscription)."""
    if opts.workers == 1:
        return [("aggregator", [*base, "--state-dir", str(state)])]
    ids = [f"w{j}" for j in range(opts.workers)]
    return [("root", [*base, "--state-dir", str(state), "--role", "root",
                      "--worker-ids", ",".join(ids)])] + [
        (w, [*base, "--role", "worker", "--id", w]) for w in ids]


def aggregator_phase(opts: FleetOptions, n: int, cfg: RunConfig, broker, fleet: Fleet,
                     fleet_name: str, encoding: str, initial_npz: Path, workdir: Path,
                     go, extra: tuple[str, ...] = (), tag: str = "",
                     duration: float = 0.0, pacing: str = "random") -> dict:
    """The same fleet against the `edgefcl aggregator` daemon (async mode, its own process),
    or a root and `opts.workers` workers; `extra` daemon flags, `tag` in file names, measured
    for `duration` s (default `opts.duration`); bursty `pacing` adds the folded rate while
    the devices have updates due (`updates_per_s_loaded`)."""
    if duration:
        opts = dataclasses.replace(opts, duration=duration)
    root = cfg.mqtt.topic_root
    state = workdir / f"state-{n}-{opts.workers}{tag}"
    conf = workdir / "daemon.toml"  # the bench's settings reach the daemon as a config file
    conf.write_text(dump_toml(dataclasses.replace(
        cfg, out="", seeds=1, compare="",
        mqtt=dataclasses.replace(cfg.mqtt, password="", broker=broker.url, fleet=fleet_name),
        fed=dataclasses.replace(cfg.fed, mode="async", encoding=encoding, clients=n))))
    base = [sys.executable, "-m", "edgefcl", "aggregator", "--config", str(conf),
            "--initial", str(initial_npz), *extra]
    watcher = StatusWatcher(broker.host, broker.port, f"{root}/{fleet_name}/aggregator/status",
                            f"{root}/{fleet_name}/workers/+" if opts.workers > 1 else "")
    daemons: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in daemon_commands(opts, base, state):
            log = workdir / f"{name}-{n}-{opts.workers}{tag}.log"
            if not daemons:
                daemons[name] = start_daemon(cmd, log, watcher)
            else:
                with open(log, "wb") as f:
                    daemons[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                                     stderr=f)
        if opts.workers > 1:
            wait_until(lambda: len(watcher.seen[-1][1].get("workers", [])) >= opts.workers,
                       60, f"{opts.workers} workers")
        print(f"{n} devices: aggregator tier ({len(daemons)} processes), "
              f"{opts.duration:.0f} s...", flush=True)
        rss = [0.0, 0.0]  # highest and latest RSS (all processes) in the window
        per = {k: 0.0 for k in daemons}
        factors: list[float] = []
        broker_rss = [rss_mb(broker.pid)]  # at the start, then every sample

        def sample() -> None:
            factors.append(fleet.factor())
            broker_rss.append(rss_mb(broker.pid))
            now = {k: rss_mb(d.pid) for k, d in daemons.items()}
            for k, v in now.items():
                per[k] = max(per[k], v)
            rss[1] = sum(now.values())
            rss[0] = max(rss[0], rss[1])

        before = {k: fleet.total(k) for k in ("published", "skipped", "lagged", "held",
                                              "downlink_bytes")}
        bc0, wall0 = cpu_seconds(broker.pid), time.time()
        cpu0 = {k: cpu_seconds(d.pid) for k, d in daemons.items()}
        load0 = os.getloadavg()[0]
        t0, t1, published = measure_window(opts, fleet, go, sample)
        wall1, bc1 = time.time(), cpu_seconds(broker.pid)
        hwm = sum(rss_mb(d.pid, "VmHWM") for d in daemons.values())  # peak since start
        cpu = {k: cpu_seconds(d.pid) - cpu0[k] for k, d in daemons.items()}
        load1 = os.getloadavg()[0]
        time.sleep(2.5)  # one more status after the window
        rate, last = watcher.accepted_rate(t0, t1 + 2.5)  # a fallback: statuses every 2 s
        busy = watcher.busy(t0 + 2.0, t1 + 2.5)  # the intervals inside the window
    finally:
        for d in reversed(list(daemons.values())):
            stop_daemon(d)
        watcher.close()
    rounds = read_rounds(state / "rounds.jsonl", wall0 + opts.warmup, wall1)
    fair = fairness(folded_per_device(state / "rounds.jsonl", wall0 + opts.warmup, wall1), n,
                    opts.ignoring)
    intervals = list(np.diff([t for t, _ in rounds])) if len(rounds) > 1 else []
    if intervals:  # updates folded into the rounds that closed in the window, per second
        rate = sum(k for _, k in rounds[1:]) / (rounds[-1][0] - rounds[0][0])
    loaded_in = {"updates_per_s_loaded": loaded_rate(rounds, wall0, wall0 + opts.warmup,
                                                     wall1)} if pacing == "bursty" else {}
    return {
        "published_per_s": published, "updates_per_s": rate,
        "round_latency_p50_s": percentile(intervals, 50),
        "round_latency_p99_s": percentile(intervals, 99), "rounds_in_window": len(intervals),
        "aggregator_rss_mb": rss[0], "aggregator_rss_end_mb": rss[1],
        "process_rss_mb": per, "process_cpu_s": cpu,
        "max_updates_per_client_round": max_per_client(state / "rounds.jsonl"),
        "load_average_1min": [load0, load1],
        "broker_cpu_s": bc1 - bc0, "seconds": t1 - t0,
        **{k: fleet.total(k) - v for k, v in before.items()},
        "dropped_connections": fleet.total("dropped"),
        "aggregator_counters": last.get("counters", {}),
        "worker_counters": _summed(b.get("counters") for b in watcher.workers.values()),
        "shed": sum(b.get("counters", {}).get("rejected_inbox_full", 0)
                    for b in (last, *watcher.workers.values())),
        "backpressure_mean": float(np.mean(factors)) if factors else 1.0,
        "backpressure_max": max(factors, default=1.0),
        "aggregator_hwm_mb": hwm, "busy": busy, **fair, **loaded_in,
        "downlink_mb_per_s": (fleet.total("downlink_bytes") - before["downlink_bytes"])
        / (t1 - t0) / 1e6,
        "broker_rss_mb": {"start": broker_rss[0], "max": max(broker_rss),
                          "end": broker_rss[-1]},
    }


def _summed(counters) -> dict[str, int]:
    """The sum of status counter maps (the workers' last statuses); malformed ones count 0."""
    total: Counter[str] = Counter()
    for c in counters:
        if isinstance(c, dict):
            total.update({k: v for k, v in c.items() if isinstance(v, int)})
    return dict(total)


def max_per_client(path: Path) -> int:
    """The most times one client appears in one round of the round log (1 when the rule
    'one update per client and round' held)."""
    rounds = _rounds_in(path, -math.inf, math.inf)
    return max((max(Counter(r["participants"]).values(), default=0) for r in rounds),
               default=0)


@contextlib.contextmanager
def fleet_on_broker(opts: FleetOptions, n: int, cfg: RunConfig, tensors: dict, workdir: Path):
    """`n` connected load-generator devices on a fresh Mosquitto; yields (broker, fleet, fleet
    name, encoding, go) and stops the devices and the broker after."""
    from edgefcl.transport.broker import start_mosquitto

    encoding = opts.payload  # an encoding's name (--payload dense | sparse)
    fleet_name = f"bench-{secrets.token_hex(3)}"
    ctx = mp.get_context("spawn")
    broker = start_mosquitto(allow_anonymous=True, config_dir=workdir / f"mosquitto-{n}")
    go, stop = ctx.Event(), ctx.Event()
    fleet = None
    try:
        print(f"{n} devices: connecting ({opts.procs(n)} processes)...", flush=True)
        fleet = start_fleet(ctx, opts, n, broker.host, broker.port, fleet_name,
                            cfg.mqtt.topic_root, encoding, tensors, go, stop,
                            cfg.fed.burn_in, cfg.fed.jump, cfg.fed.max_backpressure,
                            delta_downlink(cfg.fed))
        wait_until(lambda: fleet.total("connected") >= n, 60 + n / 20, f"{n} connections")
        yield broker, fleet, fleet_name, encoding, go
    finally:
        stop.set()
        if fleet is not None:
            for p in fleet.procs:
                p.join(10)
                if p.is_alive():
                    p.terminate()
        broker.stop()


def run_one(opts: FleetOptions, n: int, cfg: RunConfig, tensors: dict, initial_npz: Path,
            workdir: Path) -> dict:
    """Both phases for `n` devices against a fresh Mosquitto."""
    with fleet_on_broker(opts, n, cfg, tensors, workdir) as (broker, fleet, fleet_name,
                                                             encoding, go):
        print(f"{n} devices: raw broker rate, {opts.duration:.0f} s...", flush=True)
        raw = raw_phase(mp.get_context("spawn"), opts, broker,
                        f"{cfg.mqtt.topic_root}/{fleet_name}/update/+", go)
        agg = aggregator_phase(opts, n, cfg, broker, fleet, fleet_name, encoding, initial_npz,
                               workdir, go)
        return {"devices": n, "workers": opts.workers, "payload": opts.payload,
                "payload_bytes": len_payload(tensors, encoding, fleet_name),
                "offered_per_s": n * opts.rate, **raw, **agg,
                "device_processes": opts.procs(n)}


def run_overload(opts: FleetOptions, n: int, cfg: RunConfig, tensors: dict, initial_npz: Path,
                 workdir: Path) -> dict:
    """Overload for `n` devices against a fresh Mosquitto and a fresh aggregator tier (one
    aggregator, or a root and --workers workers) per phase:
    1. saturate: the nominal load (n x --rate), backpressure off: the rate the tier folds;
    2. 1x: that rate offered (backpressure off), then 1.5x the last folded rate while the tier
       folds at least 0.95 of what it is offered (at most RAMP_STEPS times): the capacity is
       the best folded rate of these phases (an overloaded tier spends its CPU reading what
       it sheds, so the saturating phase under-reads it, 0.5x at 1,000 devices);
    3. X x the capacity offered for --duration s, backpressure on, then off, the devices paced
       by --pacing (1 and 2 start them at random phases: a synchronised fleet without
       backpressure measures its bursts, not the tier; bursty devices are measured while
       they have updates due).
    Folded rates count the updates in the rounds closed in each window."""
    off = ("--max-backpressure", "1")
    on = ("--max-backpressure", str(max(cfg.fed.max_backpressure, 1.0)))
    phases: dict[str, dict] = {}
    with fleet_on_broker(opts, n, cfg, tensors, workdir) as (broker, fleet, fleet_name,
                                                             encoding, go):
        args = (opts, n, cfg, broker, fleet, fleet_name, encoding, initial_npz, workdir, go)

        def phase(name: str, rate: float, flags: tuple[str, ...], seconds: float,
                  pacing: str = "random") -> dict:
            if not rate > 0:
                raise ConfigError("bench fleet --overload: the aggregator folded nothing in the "
                                  "capacity window (no round closed); raise "
                                  "--capacity-duration")
            fleet.rate.value = rate / n
            fleet.pacing.value = PACINGS.index(pacing)
            print(f"{n} devices, {name}: {rate:.1f} updates/s offered", flush=True)
            r = aggregator_phase(*args, extra=flags, tag=f"-{name}", duration=seconds,
                                 pacing=pacing)
            phases[name] = {"phase": name, "offered_per_s": rate, **r}
            print(overload_table([phases[name]]).splitlines()[1], flush=True)
            return phases[name]

        saturating = phase("saturate", n * opts.rate, off, opts.capacity_duration)
        one = last = phase("1x", saturating["updates_per_s"], off, opts.capacity_duration)
        for k in range(RAMP_STEPS):
            if last["updates_per_s"] < 0.95 * last["offered_per_s"]:
                break
            last = phase(f"ramp {k + 1}", 1.5 * last["updates_per_s"], off,
                         opts.capacity_duration)
        capacity = max(p["updates_per_s"] for p in phases.values())
        x = f"{opts.overload:g}x"
        for name, flags in ((f"{x}-backpressure", on), (f"{x}-no-backpressure", off)):
            phase(name, opts.overload * capacity, flags, opts.duration, opts.pacing)
    for r in phases.values():  # bursty: while the devices have updates due
        r["ratio_to_capacity"] = r.get("updates_per_s_loaded", r["updates_per_s"]) / (
            capacity) if capacity else None
    return {"devices": n, "payload": opts.payload, "overload": opts.overload,
            "payload_bytes": len_payload(tensors, encoding, fleet_name),
            "capacity_saturating_per_s": saturating["updates_per_s"],
            "capacity_per_s": capacity,
            "capacity_from_busy_per_s": one["updates_per_s"] / one["busy"]
            if one["busy"] else None,
            "accepted_over_offered_at_1x": one["updates_per_s"] / one["offered_per_s"]
            if one["offered_per_s"] else None,
            "phases": list(phases.values()), "device_processes": opts.procs(n)}


RAMP_STEPS = 3
"""Phases of `bench fleet --overload` that raise the offered load to find the capacity."""


def folded_per_device(path: Path, t0: float, t1: float) -> Counter:
    """Updates of each device folded into the rounds of the daemon's round log closed in
    [t0, t1] (wall clock)."""
    return Counter(c for r in _rounds_in(path, t0, t1) for c in r["participants"])


def fairness(folded: Counter, n: int, ignoring: float) -> dict:
    """The median folded updates of the devices that follow the factor and, with a fraction
    `ignoring` of the fleet ignoring it (`loadgen.devices.ignores`), theirs and the ratio of
    the two (the bar: at most 1.5)."""
    groups: dict[bool, list[int]] = {False: [], True: []}
    for i in range(n):
        groups[ignores(i, ignoring)].append(folded.get(device_id(i), 0))
    out = {"folded_median_compliant": float(np.median(groups[False])) if groups[False] else 0.0}
    if groups[True]:
        out["folded_median_ignoring"] = float(np.median(groups[True]))
        out["ignoring_over_compliant"] = (out["folded_median_ignoring"]
                                          / max(out["folded_median_compliant"], 1e-9))
    return out


def loaded_rate(rounds: list[tuple[float, int]], start: float, t0: float, t1: float) -> float:
    """Updates a second folded in the `rounds` ((close time, updates)) that closed while
    devices paced bursty from `start` had updates due, over those seconds of [t0, t1]."""
    seconds = loaded_seconds(t0 - start, t1 - start, "bursty")
    folded = sum(k for t, k in rounds if t0 <= t <= t1 and loaded(t - start, "bursty"))
    return folded / seconds if seconds else 0.0


def read_rounds(path: Path, t0: float, t1: float) -> list[tuple[float, int]]:
    """(close time, updates folded) of the rounds in the daemon's round log closed in
    [t0, t1] (wall clock)."""
    return [(r["time"], len(r["participants"])) for r in _rounds_in(path, t0, t1)]


def _rounds_in(path: Path, t0: float, t1: float) -> list[dict]:
    import json

    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if t0 <= r["time"] <= t1]


def len_payload(tensors: dict, encoding: str, fleet: str) -> int:
    from edgefcl.bench.loadgen.template import UpdateTemplate

    return len(UpdateTemplate(tensors, encoding, fleet))


# -- report ---------------------------------------------------------------------------------
def table(runs: list[dict]) -> str:
    head = (f"{'devices':>7} {'W':>2} {'payload':>7} {'bytes':>7} {'offered/s':>9} {'sent/s':>8} "
            f"{'agg/s':>8} {'raw/s':>8} {'agg/raw':>7} {'round p50':>9} {'p99 s':>7} "
            f"{'agg RSS MB':>10} {'broker cpu s':>12} {'load':>5}")
    lines = [head]
    for r in runs:
        ratio = r["updates_per_s"] / r["raw_broker_updates_per_s"] if r[
            "raw_broker_updates_per_s"] else float("nan")
        p50, p99 = r["round_latency_p50_s"], r["round_latency_p99_s"]
        lines.append(
            f"{r['devices']:7d} {r['workers']:2d} {r['payload']:>7} {r['payload_bytes']:7d} "
            f"{r['offered_per_s']:9.0f} {r['published_per_s']:8.1f} {r['updates_per_s']:8.1f} "
            f"{r['raw_broker_updates_per_s']:8.1f} {ratio:7.2f} "
            f"{p50 if p50 is not None else float('nan'):9.2f} "
            f"{p99 if p99 is not None else float('nan'):7.2f} "
            f"{r['aggregator_rss_mb']:10.0f} {r['broker_cpu_s']:12.1f} "
            f"{r['load_average_1min'][1]:5.1f}")
    return "\n".join(lines)


def overload_table(phases: list[dict]) -> str:
    """One line per overload phase; `vs cap` is folded / capacity, `max/round` the most times
    one client was in one round, `ign/comp` the median folded updates of the devices that
    ignore the factor over the others' (with --ignoring), `down MB/s` the globals the devices
    received (with --globals every or pull), `broker MB` the broker's RSS at the start > its
    highest, `busy` the aggregator's mean main-loop busy share (its statuses; with --workers
    the root's)."""
    head = (f"{'phase':>22} {'offered/s':>9} {'sent/s':>8} {'folded/s':>8} {'vs cap':>6} "
            f"{'shed':>6} {'factor mean/max':>15} {'RSS MB':>7} {'HWM MB':>7} "
            f"{'max/round':>9} {'ign/comp':>8} {'down MB/s':>9} {'broker MB':>13} "
            f"{'load':>5} {'busy':>5}")
    lines = [head]
    for r in phases:
        ratio = r.get("ratio_to_capacity")
        lines.append(
            f"{r['phase']:>22} {r['offered_per_s']:9.1f} {r['published_per_s']:8.1f} "
            f"{r['updates_per_s']:8.1f} {ratio if ratio is not None else float('nan'):6.2f} "
            f"{r['shed']:6d} {r['backpressure_mean']:7.2f}/{r['backpressure_max']:<7.2f} "
            f"{r['aggregator_rss_mb']:7.0f} {r['aggregator_hwm_mb']:7.0f} "
            f"{r['max_updates_per_client_round']:9d} "
            f"{r.get('ignoring_over_compliant', float('nan')):8.2f} "
            f"{r['downlink_mb_per_s']:9.1f} "
            f"{r['broker_rss_mb']['start']:6.0f}>{r['broker_rss_mb']['max']:<6.0f} "
            f"{r['load_average_1min'][1]:5.1f} {_fmt_share(r.get('busy')):>5}")
    return "\n".join(lines)


def _fmt_share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def plot(runs: list[dict], path: Path) -> None:
    """Ingest rate (offered, raw broker, aggregator) and round interval against devices."""
    from edgefcl.outcomes.report import pyplot

    plt = pyplot()
    n = [r["devices"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["offered_per_s"] for r in runs], "k--", label="offered")
    a.plot(n, [r["raw_broker_updates_per_s"] for r in runs], "o-", label="raw broker")
    a.plot(n, [r["updates_per_s"] for r in runs], "s-", label="aggregator")
    a.set(xlabel="devices", ylabel="updates / s", title=f"ingest ({runs[0]['payload']})")
    b.plot(n, [r["round_latency_p99_s"] or np.nan for r in runs], "s-", label="p99")
    b.plot(n, [r["round_latency_p50_s"] or np.nan for r in runs], "o--", label="p50")
    b.set(xlabel="devices", ylabel="round interval (s)", title="round interval")
    for ax in (a, b):
        if len(set(n)) > 1:
            ax.set_xscale("log")
        ax.set_xticks(n, [str(x) for x in n])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_fleet(opts: FleetOptions, cfg: RunConfig, out: Path) -> dict:
    """Run every device count; write DIR/bench_fleet.json and DIR/bench_fleet.png."""
    import json

    from edgefcl.support.statefiles import save_tensors

    if not (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()):
        raise ConfigError("bench fleet needs the mosquitto binary (apt-get install mosquitto)")
    limit = raise_fd_limit()  # Mosquitto and the daemon inherit it
    need = max(opts.devices) + 64
    if limit < need:
        raise ConfigError(f"bench fleet: {max(opts.devices)} devices need more than {limit} "
                          "open files (ulimit -n)")
    out.mkdir(parents=True, exist_ok=True)
    initial = demo_tensors(cfg)
    tensors = update_tensors(initial, opts.payload, cfg)
    runs, overload = [], []
    with tempfile.TemporaryDirectory(prefix="edgefcl-fleet-") as tmp:
        work = Path(tmp)
        initial_npz = work / "initial.npz"
        save_tensors(initial_npz, initial)
        for n in opts.devices:
            if opts.overload:
                overload.append(run_overload(opts, n, cfg, tensors, initial_npz, work))
            else:
                runs.append(run_one(opts, n, cfg, tensors, initial_npz, work))
                print(table(runs[-1:]).splitlines()[1], flush=True)
        for n in opts.devices:
            for keep in work.glob(f"*-{n}-{opts.workers}*.log"):
                shutil.copy(keep, out / f"bench_fleet_{keep.name}")
    report = {"runs": runs, "rate": opts.rate, "duration_s": opts.duration,
              "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if overload:
        report["overload"] = overload
    (out / "bench_fleet.json").write_text(json.dumps(report, indent=1, default=_jsonable))
    print()
    if runs:
        print(table(runs))
        plot(runs, out / "bench_fleet.png")
    for o in overload:
        print(f"{o['devices']} devices, {o['payload']}: capacity {o['capacity_per_s']:.1f} "
              f"updates/s (saturating load: {o['capacity_saturating_per_s']:.1f}; accepted / "
              f"offered at 1x {o['accepted_over_offered_at_1x'] or 0:.2f}; the main loop's own "
              f"estimate at 1x, folded / busy share: "
              f"{o['capacity_from_busy_per_s'] or float('nan'):.1f})")
        print(overload_table(o["phases"]))
    print(f"\nwritten {out / 'bench_fleet.json'}" + (f" and {out / 'bench_fleet.png'}"
                                                      if runs else ""))
    return report


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))


def run_from_args(args: argparse.Namespace, cfg: RunConfig, out: Path) -> int:
    """`edgefcl bench fleet` entry point."""
    bench_fleet(FleetOptions.from_args(args), cfg, out)
    return 0

