"""The fleet launcher: a broker, the aggregator daemon, the stream replayer and simulated
devices (several per host process), with faults injected on a plan, and a report.

Processes: `python -m edgefcl aggregator` and `python -m edgefcl replay` (the real daemons) and
`python -m firmware_sim device` hosts. The launcher watches the devices' status topics to
know the fleet's progress (batches consumed / batches in all streams) and injects each fault
of the FaultPlan when the progress passes its threshold: SIGKILL of whole host processes
(restarted after `kill_down_s`), link cuts (a command on the host's stdin), a graceful broker
restart (Mosquitto with persistence), damaged copies of updates (faults.Corruptor) and clock
skews (given to the devices at start).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.build import initial_global, make_client, prepare
from edgefcl.config import ConfigError, RunConfig, dump_toml, load_toml
from edgefcl.data.streams import stream_batches
from edgefcl.data.workload import client_id
from edgefcl.metrics import forgetting
from edgefcl.runtime.links import open_link, topics
from edgefcl.statefiles import load_json, save_tensors
from edgefcl.transport.broker import start_mosquitto
from edgefcl.transport.codec import CodecError, Message, decode
from firmware_sim.byzantine import ATTACKS, Byzantine
from firmware_sim.device import expected_digest
from firmware_sim.faults import (
    CORRUPTION_REASONS,
    Corruptor,
    FaultPlan,
    clock_skews,
    persistence_conf,
    pick,
    restart_broker,
)
from firmware_sim.profile import check_memory_budget, load_profile

log = logging.getLogger("firmware_sim.fleet")

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = PACKAGE_DIR / "fleet.toml"
DEFAULT_PROFILE = PACKAGE_DIR / "profiles" / "sensor-node.toml"
QUIET_STATUSES = 2
"""The aggregator is idle once this many of its periodic statuses showed the same counters."""


class FleetError(RuntimeError):
    """The fleet did not finish; the message says which process and shows its log tail."""


@dataclass
class FleetOptions:
    """What to run: devices, profiles, configuration, broker and pacing."""

    devices: int = 20
    profiles: list[Path] = field(default_factory=lambda: [DEFAULT_PROFILE])
    config: Path | None = None
    broker: str = "mosquitto"
    per_process: int = 4
    rate: float = 2.0
    seed: int = 0
    timeout: float = 900.0
    byzantine: int = 0
    """Attacker identities added to the honest devices (firmware_sim.byzantine)."""
    attack: str = "noise"
    defences: bool = True
    """False: the robust aggregation rules off (clipping, share cap, sigma floor); the
    structural and admission checks always stay."""


def fleet_config(opts: FleetOptions) -> RunConfig:
    """The run configuration of the fleet (async mode, one client per device)."""
    cfg = load_toml(opts.config or DEFAULT_CONFIG)
    if opts.devices < 2:
        raise ConfigError("--devices must be >= 2 (a round needs two updates)")
    cfg.fed.clients = opts.devices
    cfg.fed.roster_cap = opts.devices + opts.byzantine  # the roster admits the attackers too
    cfg.seed = opts.seed
    if opts.byzantine < 0:
        raise ConfigError("--byzantine must be >= 0")
    if opts.attack not in ATTACKS:
        raise ConfigError(f"unknown --attack {opts.attack!r}; choose from {', '.join(ATTACKS)}")
    if not opts.defences:
        cfg.fed.clip_factor, cfg.fed.clip_norm = 0.0, 0.0
        cfg.fed.max_share, cfg.fed.sigma_floor = 1.0, 0.0
    if cfg.fed.mode != "async":
        raise ConfigError("the fleet runs in async mode (set [fed] mode = \"async\")")
    if opts.per_process < 1:
        raise ConfigError("--per-process must be >= 1")
    if opts.rate < 0:
        raise ConfigError("--rate must be >= 0 (0: as fast as the devices consume)")
    return cfg


class Fleet:
    """One fleet run in `workdir` (see the module docstring); `run()` returns the report."""

    def __init__(self, opts: FleetOptions, plan: FaultPlan, workdir: Path,
                 echo: bool = True) -> None:
        plan.validate()
        self.opts, self.plan, self.workdir = opts, plan, Path(workdir)
        self.echo = echo
        self.cfg = fleet_config(opts)
        self.profiles = [load_profile(p) for p in opts.profiles]
        self.profile_paths = [Path(p).resolve() for p in opts.profiles]
        self.rng = random.Random(opts.seed)
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts: dict[str, list[str]] = {}
        self.events: list[dict[str, Any]] = []
        self.consumed: dict[str, int] = {}
        self.agg_status: dict[str, Any] = {}
        self.agg_statuses = 0  # aggregator status messages received
        self.mosq = None
        self.t0 = time.monotonic()

    # -- setup ----------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.echo:
            print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", flush=True)

    def _event(self, what: str, **info: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 2), "what": what, **info})
        self._say(what + (" " + json.dumps(info) if info else ""))

    def _prepare(self) -> None:
        """Data file, initial model, config file, host specs; checks every profile's memory
        budget before anything starts."""
        w = self.workdir
        cfg = self.cfg
        setup = prepare(cfg, cfg.seed)
        ds = setup.dataset
        data = w / "dataset.npz"  # generated once; every process loads the same arrays
        arrays = {"x": ds.x_train, "y": ds.y_train}
        if ds.x_test is not None:
            arrays |= {"x_test": ds.x_test, "y_test": ds.y_test}
        np.savez(data, **arrays)
        cfg.data.dataset = f"npz:{data}"
        for i, prof in enumerate(self.profiles):  # refuse before starting: same check as boot
            k = i % cfg.fed.clients
            client = make_client(cfg, setup, k, cfg.learn.method, cfg.seed)
            check_memory_budget(prof, client, ds.sample_shape)
        save_tensors(w / "initial.npz", initial_global(cfg, setup))
        self.expected = {}
        for k in range(cfg.fed.clients):
            keys = [(b.task, b.index) for b in stream_batches(setup.tasks[k], cfg.data.batch_size,
                                                             cfg.seed * 1000 + k)]
            self.expected[client_id(k)] = {"count": len(keys), "digest": expected_digest(keys)}
        self.total = sum(e["count"] for e in self.expected.values())
        (w / "fleet.toml").write_text(dump_toml(cfg))
        skews = clock_skews(list(self.expected), self.plan.skew_s, self.rng)
        hosts = w / "hosts"
        hosts.mkdir(exist_ok=True)
        cids = list(self.expected)
        per = self.opts.per_process
        for h in range(0, len(cids), per):
            name = f"host{h // per:02d}"
            group = cids[h:h + per]
            specs = [{"index": int(c[1:]), "skew_s": skews[c],
                      "profile": str(self.profile_paths[int(c[1:]) % len(self.profiles)])}
                     for c in group]
            (hosts / f"{name}.json").write_text(json.dumps(specs, indent=1))
            self.hosts[name] = group

    def _spawn(self, name: str, args: list[str], stdin: bool = False) -> subprocess.Popen:
        log_path = self.workdir / "logs" / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(PACKAGE_DIR.parent), *filter(None, [env.get("PYTHONPATH")])])
        with open(log_path, "ab") as f:
            p = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                 env=env, text=stdin or None)
        self.procs[name] = p
        return p

    def _spawn_host(self, name: str) -> None:
        w = self.workdir
        self._spawn(name, ["-m", "firmware_sim", "-v", "device", "--config", str(w / "fleet.toml"),
                           "--devices-file", str(w / "hosts" / f"{name}.json"),
                           "--state-dir", str(w / "flash"), "--results", str(w / "results"),
                           "--commands"], stdin=True)

    def _command(self, host: str, line: str) -> None:
        p = self.procs[host]
        try:
            p.stdin.write(line + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            log.warning("host %s did not take command %r", host, line)

    # -- monitoring -----------------------------------------------------------------------
    def _on_status(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.cfg.mqtt.fleet)
        except CodecError:
            return
        if not isinstance(msg, Message) or msg.kind != "status":
            return
        if topic == self.topics.aggregator_status:
            self.agg_status = msg.body
            self.agg_statuses += 1
        elif "consumed" in msg.body:
            cid = self.topics.client_from(topic)
            self.consumed[cid] = max(self.consumed.get(cid, 0), int(msg.body["consumed"]))

    @property
    def progress(self) -> float:
        return sum(self.consumed.values()) / max(self.total, 1)

    def _tail(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the fleet to the end of every stream and return the report."""
        w = self.workdir
        for sub in ("logs", "results", "flash", "aggregator"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            stack.callback(self._stop_all)
            self._start_broker()
            self.cfg.mqtt.fleet = f"fw{secrets.token_hex(3)}"
            self._prepare()
            self.topics = topics(self.cfg.mqtt)
            conf = str(w / "fleet.toml")
            self._spawn("aggregator", ["-m", "edgefcl", "-v", "aggregator", "--config", conf,
                                       "--state-dir", str(w / "aggregator"),
                                       "--initial", str(w / "initial.npz")])
            for name in self.hosts:
                self._spawn_host(name)
            self._spawn("replayer", ["-m", "edgefcl", "-v", "replay", "--config", conf,
                                     "--rate", str(self.opts.rate)])
            watch = open_link(self.cfg.mqtt, f"{self.cfg.mqtt.fleet}-launcher", clean_start=True)
            stack.callback(watch.close)
            watch.subscribe(self.topics.statuses, self._on_status)
            watch.subscribe(self.topics.aggregator_status, self._on_status)
            self.byzantine = None
            if self.opts.byzantine > 0:
                period = self.cfg.fed.jump / self.opts.rate if self.opts.rate > 0 else 0.5
                self.byzantine = Byzantine(self.cfg, self.opts.byzantine, self.opts.attack,
                                           period=max(0.2, period), seed=self.opts.seed,
                                           ready=lambda: self.progress > 0.05)
                self.byzantine.start()
                stack.callback(self.byzantine.close)
            self.corruptor = None
            if self.plan.corrupt > 0:
                self.corruptor = Corruptor(self.cfg.mqtt, self.plan.corrupt, self.opts.seed)
                stack.callback(self.corruptor.close)
            self._event("started", devices=self.opts.devices, hosts=len(self.hosts),
                        broker=self.cfg.mqtt.broker)
            self._supervise()
            self._finish()
            report = self._report()
            (w / "report.json").write_text(json.dumps(report, indent=1))
            return report

    def _start_broker(self) -> None:
        if self.opts.broker == "mosquitto":
            conf_dir = self.workdir / "mosquitto"
            self.persist = persistence_conf(conf_dir)
            self.mosq = start_mosquitto(config_dir=conf_dir, allow_anonymous=True,
                                        extra_conf=self.persist)
            self.cfg.mqtt.broker = self.mosq.url
            return
        if not self.opts.broker.startswith("mqtt://"):
            raise ConfigError("--broker must be 'mosquitto' (start a local one) or mqtt://HOST:PORT")
        if self.plan.broker_restart_at >= 0:
            raise ConfigError("--broker-restart-at needs --broker mosquitto (the launcher must "
                              "own the broker to restart it)")
        self.cfg.mqtt.broker = self.opts.broker

    def _supervise(self) -> None:
        """Wait for every host to finish, injecting the planned faults on the way."""
        plan = self.plan
        pending = {"kill": plan.kill > 0, "cut": plan.cut > 0,
                   "broker": plan.broker_restart_at >= 0}
        restart_at: dict[str, float] = {}
        deadline = time.monotonic() + self.opts.timeout
        while True:
            now = time.monotonic()
            if now > deadline:
                raise FleetError(f"the fleet did not finish within {self.opts.timeout:.0f} s "
                                 f"(progress {100 * self.progress:.0f} %); logs in "
                                 f"{self.workdir / 'logs'}")
            running = False
            for name, p in list(self.procs.items()):
                code = p.poll()
                if name in restart_at:
                    if now >= restart_at[name]:
                        del restart_at[name]
                        self._spawn_host(name)
                        self._event("restarted", host=name, devices=self.hosts[name])
                    running = True
                elif code is None:
                    running = running or name in self.hosts
                elif name == "aggregator" or code != 0:  # hosts and the replayer exit with 0
                    raise FleetError(f"{name} exited with code {code}:\n{self._tail(name)}")
            if not running:
                return
            progress = self.progress
            if pending["kill"] and progress >= plan.kill_at:
                pending["kill"] = False
                for name in self._hosts_to_kill():
                    self.procs[name].send_signal(signal.SIGKILL)
                    self.procs[name].wait()
                    restart_at[name] = time.monotonic() + plan.kill_down_s
                    self._event("kill -9", host=name, devices=self.hosts[name])
            if pending["cut"] and progress >= plan.cut_at:
                pending["cut"] = False
                for cid in pick(sorted(self.expected), plan.cut, self.rng):
                    host = next(h for h, ds in self.hosts.items() if cid in ds)
                    self._command(host, f"cut {cid} {plan.cut_s}")
                    self._event("link cut", device=cid, seconds=plan.cut_s)
            if pending["broker"] and progress >= plan.broker_restart_at:
                pending["broker"] = False
                self._restart_broker()
            time.sleep(0.1)

    def _hosts_to_kill(self) -> list[str]:
        """Whole hosts, chosen at random, until at least `kill` x devices are covered."""
        want = round(self.plan.kill * self.opts.devices)
        names = list(self.hosts)
        self.rng.shuffle(names)
        chosen, n = [], 0
        for name in names:
            if n >= want:
                break
            chosen.append(name)
            n += len(self.hosts[name])
        return chosen

    def _restart_broker(self) -> None:
        if self.corruptor is not None:  # no damaged copy in flight across the restart
            self.corruptor.paused.set()
            self.corruptor.drain()
            time.sleep(0.5)
        self._event("broker restart", down_s=self.plan.broker_down_s)
        self.mosq = restart_broker(self.mosq, self.plan.broker_down_s, self.persist)
        if self.corruptor is not None:
            time.sleep(1.0)
            self.corruptor.paused.clear()

    def _finish(self) -> None:
        """Let the aggregator take in the last messages, then stop it (it saves its state)."""
        if self.corruptor is not None:
            self.corruptor.drain()
        if self.byzantine is not None:
            self.byzantine.close()
        last, since = None, self.agg_statuses
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counters = json.dumps(self.agg_status.get("counters", {}), sort_keys=True)
            if counters != last:
                last, since = counters, self.agg_statuses
            elif self.agg_statuses - since >= QUIET_STATUSES:
                break
            time.sleep(0.2)
        agg = self.procs["aggregator"]
        self.aggregator_alive = agg.poll() is None
        agg.send_signal(signal.SIGTERM)
        try:
            agg.wait(30)
        except subprocess.TimeoutExpired:
            agg.kill()
        rep = self.procs["replayer"]
        try:
            rep.wait(10)
        except subprocess.TimeoutExpired:
            rep.terminate()
        self._event("finished", progress=round(self.progress, 3))

    def _stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.mosq is not None:
            self.mosq.stop()

    # -- report ---------------------------------------------------------------------------
    def _report(self) -> dict[str, Any]:
        w = self.workdir
        state = load_json(w / "aggregator" / "state.json")
        counters = state.get("counters", {})
        rejected = {k[len("rejected_"):]: v for k, v in counters.items()
                    if k.startswith("rejected_")}
        devices: dict[str, Any] = {}
        for cid, exp in self.expected.items():
            r = json.loads((w / "results" / f"{cid}.json").read_text())
            acc = np.asarray(r["accuracy_matrix"], np.float64)
            fw, link, trained = r["firmware"], r["link"], r["trained"]
            devices[cid] = {
                "profile": r["profile"], "batches": r["batches"], "expected": exp["count"],
                "exactly_once": (trained["count"] == exp["count"]
                                 and trained["digest"] == exp["digest"]
                                 and trained["out_of_order"] == 0),
                "A": 100 * float(acc[-1].mean()), "F": 100 * forgetting(acc[None]),
                "rounds": r["rounds"], "catch_ups": r.get("catch_ups", 0), "seq": r["seq"],
                "aggregator_last_seq": state.get("last_seq", {}).get(cid, 0),
                "reconnects": link.get("reconnects", 0), "boots": fw.get("boots", 1),
                "inbox_replayed": fw.get("inbox_replayed", 0),
                "redelivered_dropped": fw.get("redelivered_dropped", 0),
                "resent_updates": fw.get("resent_updates", 0),
                "skipped_scoring": fw.get("skipped_scoring", 0),
                "throttle_s": round(fw.get("throttle_s", 0.0), 2),
                "clock_skew_s": round(r.get("clock_skew_s", 0.0), 1),
            }
        corrupt_rejected = sum(rejected.get(k, 0) for k in CORRUPTION_REASONS)
        tap = dict(self.corruptor.counters) if self.corruptor is not None else {}
        created = sum(d["seq"] for d in devices.values())
        if self.byzantine is not None:  # what the attackers sent may be accepted too
            created += sum(self.byzantine.sent.values())
        accepted = counters.get("accepted", 0)
        checks = {
            "every_stream_finished": all(d["batches"] == d["expected"] for d in devices.values()),
            "no_data_reconsumed": all(d["exactly_once"] for d in devices.values()),
            "no_duplicate_aggregated": accepted <= created and all(
                d["aggregator_last_seq"] <= d["seq"] for d in devices.values()),
            "every_corrupted_payload_rejected": (tap.get("undetected", 0) == 0
                                                 and corrupt_rejected >= tap.get("injected", 0)),
        }
        return {
            "devices": len(devices), "hosts": len(self.hosts),
            "per_process": self.opts.per_process, "profiles": [p.name for p in self.profiles],
            "seed": self.opts.seed, "broker": self.opts.broker, "rate": self.opts.rate,
            "faults": dataclasses.asdict(self.plan), "events": self.events,
            "wall_s": round(time.monotonic() - self.t0, 1),
            "rounds": state.get("rounds", 0), "version": state.get("version", 0),
            "updates": {"created": created, "accepted": accepted,
                        "duplicates": rejected.get("duplicate", 0),
                        "stale": rejected.get("stale", 0),
                        "corrupted_rejected": corrupt_rejected, "rejected": rejected},
            "corruptor": tap,
            "reconnects": sum(d["reconnects"] for d in devices.values()),
            "A": float(np.mean([d["A"] for d in devices.values()])),
            "F": float(np.mean([d["F"] for d in devices.values()])),
            "checks": checks, "per_device": devices,
            "robust": {k: v for k, v in counters.items()
                       if k in ("clipped", "share_capped", "sigma_floored", "replaced",
                                "new_sessions", "silent_left")},
            "byzantine": {"k": self.opts.byzantine, "attack": self.opts.attack,
                          "defences": self.opts.defences,
                          "sent": dict(self.byzantine.sent) if self.byzantine else {},
                          "aggregator_alive_at_end": getattr(self, "aggregator_alive", None)},
        }


def format_report(r: dict[str, Any]) -> str:
    """The report as text: totals, checks, then one line per device."""
    u = r["updates"]
    rej = ", ".join(f"{k} {v}" for k, v in sorted(r["updates"]["rejected"].items())) or "none"
    faults = [e for e in r["events"] if e["what"] not in ("started", "finished", "restarted")]
    lines = [
        f"fleet: {r['devices']} devices on {r['hosts']} host processes, profiles "
        f"{', '.join(r['profiles'])}, broker {r['broker']}, seed {r['seed']}, "
        f"{r['wall_s']:.0f} s",
        "faults: " + ("; ".join(f"{e['what']} at {e['t']:.0f} s" for e in faults) or "none"),
        f"rounds {r['rounds']} (global version {r['version']}); updates: created {u['created']}, "
        f"accepted {u['accepted']}, duplicates dropped {u['duplicates']}, stale {u['stale']}, "
        f"corrupted rejected {u['corrupted_rejected']}",
        f"rejections by reason: {rej}",
    ]
    if r["corruptor"]:
        c = r["corruptor"]
        lines.append(f"damaged copies injected {c.get('injected', 0)} (flipped "
                     f"{c.get('mode_flip', 0)}, truncated {c.get('mode_truncate', 0)}), "
                     f"undetected by the codec {c.get('undetected', 0)}")
    b = r.get("byzantine", {})
    if b.get("k"):
        robust = ", ".join(f"{k} {v}" for k, v in sorted(r.get("robust", {}).items())) or "none"
        lines.append(f"byzantine: {b['k']} x {b['attack']}, defences "
                     f"{'on' if b['defences'] else 'off'}, sent {sum(b['sent'].values())}; "
                     f"robust rules applied: {robust}; aggregator alive at the end "
                     f"{'yes' if b['aggregator_alive_at_end'] else 'NO'}")
    lines.append(f"reconnects {r['reconnects']};  A = {r['A']:.1f} %   F = {r['F']:.1f} %")
    lines.append("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                        for k, v in r["checks"].items()))
    head = (f"{'device':7} {'profile':14} {'batches':>7} {'once':>4} {'A %':>6} {'F %':>6} "
            f"{'rounds':>6} {'catch':>5} {'seq':>4} {'reconn':>6} {'boots':>5} {'inbox':>5} "
            f"{'resent':>6} {'skip':>4} {'skew s':>8}")
    lines += ["", head]
    for cid, d in r["per_device"].items():
        lines.append(
            f"{cid:7} {d['profile'][:14]:14} {d['batches']:>3}/{d['expected']:<3} "
            f"{'yes' if d['exactly_once'] else 'NO':>4} {d['A']:6.1f} {d['F']:6.1f} "
            f"{d['rounds']:6d} {d['catch_ups']:5d} {d['seq']:4d} {d['reconnects']:6d} "
            f"{d['boots']:5d} {d['inbox_replayed']:5d} {d['resent_updates']:6d} "
            f"{d['skipped_scoring']:4d} {d['clock_skew_s']:8.1f}")
    return "\n".join(lines)
