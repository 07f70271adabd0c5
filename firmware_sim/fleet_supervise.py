"""Supervise a firmware_sim fleet run: start the broker, the aggregator and replayer daemons and
the device hosts (through the shared process supervisor, edgefcl/runtime/supervisor.py), follow
the fleet's progress on its status topics, inject each fault of the FaultPlan when the progress
passes its threshold (SIGKILL of whole hosts restarted after `kill_down_s`, link cuts as a
command on a host's stdin, a broker restart), and stop the daemons once the aggregator is idle."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from edgefcl.config import ConfigError, RunConfig
from edgefcl.runtime.supervisor import Deadline, FleetProgress, Process, Supervisor
from edgefcl.transport.broker import MosquittoProcess, start_mosquitto
from firmware_sim.faults import Corruptor, FaultPlan, persistence_conf, pick, restart_broker
from firmware_sim.fleet_prepare import PACKAGE_DIR, FleetLayout

log = logging.getLogger("firmware_sim.fleet")

QUIET_STATUSES = 2
"""The aggregator is idle once this many of its periodic statuses showed the same counters."""


class EventLog:
    """What happened when (seconds since the start), echoed as a line when `echo`."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        if self.echo:
            print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def __call__(self, what: str, **info: Any) -> None:
        self.events.append({"t": round(self.elapsed(), 2), "what": what, **info})
        self.say(what + (" " + json.dumps(info) if info else ""))


class Broker:
    """The fleet's broker: a local Mosquitto with persistence that the launcher owns (and can
    restart), or one given as mqtt://HOST:PORT."""

    def __init__(self, spec: str, plan: FaultPlan, conf_dir: Path) -> None:
        self.mosq: MosquittoProcess | None = None
        if spec == "mosquitto":
            self.persist = persistence_conf(conf_dir)
            self.mosq = start_mosquitto(config_dir=conf_dir, allow_anonymous=True,
                                        extra_conf=self.persist)
            self.url = self.mosq.url
            return
        if not spec.startswith("mqtt://"):
            raise ConfigError("--broker must be 'mosquitto' (start a local one) or mqtt://HOST:PORT")
        if plan.broker_restart_at >= 0:
            raise ConfigError("--broker-restart-at needs --broker mosquitto (the launcher must "
                              "own the broker to restart it)")
        self.url = spec

    def restart(self, down_s: float) -> None:
        assert self.mosq is not None
        self.mosq = restart_broker(self.mosq, down_s, self.persist)

    def stop(self) -> None:
        if self.mosq is not None:
            self.mosq.stop()


def _popen(args: list[str], log_path: Path, stdin: bool = False) -> subprocess.Popen:
    """`python ARGS` with this firmware_sim importable, stdout and stderr to `log_path`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_DIR.parent), *filter(None, [env.get("PYTHONPATH")])])
    with open(log_path, "ab") as f:
        return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                env=env, text=stdin or None)


class FleetProcesses:
    """The fleet's processes and its fault injection (see the module docstring)."""

    def __init__(self, cfg: RunConfig, workdir: Path, layout: FleetLayout, plan: FaultPlan,
                 devices: int, events: EventLog, rng: random.Random) -> None:
        self.cfg, self.workdir, self.layout, self.plan = cfg, workdir, layout, plan
        self.devices, self.events, self.rng = devices, events, rng
        self.procs = Supervisor(workdir / "logs")
        self.conf = str(workdir / "fleet.toml")

    def start(self, rate: float) -> None:
        """The aggregator, every host, then the replayer (pacing `rate` batches/s/device)."""
        w = self.workdir
        self.procs.start("aggregator", lambda log_path: _popen(
            ["-m", "edgefcl", "-v", "aggregator", "--config", self.conf, "--state-dir",
             str(w / "aggregator"), "--initial", str(w / "initial.npz")], log_path))
        for name in self.layout.hosts:
            self.start_host(name)
        self.procs.start("replayer", lambda log_path: _popen(
            ["-m", "edgefcl", "-v", "replay", "--config", self.conf, "--rate", str(rate)],
            log_path))

    def start_host(self, name: str) -> None:
        w = self.workdir
        self.procs.start(name, lambda log_path: _popen(
            ["-m", "firmware_sim", "-v", "device", "--config", self.conf, "--devices-file",
             str(w / "hosts" / f"{name}.json"), "--state-dir", str(w / "flash"), "--results",
             str(w / "results"), "--commands"], log_path, stdin=True))

    def command(self, host: str, line: str) -> None:
        """Send `line` to a host's command stdin."""
        p: Any = self.procs[host]
        try:
            p.stdin.write(line + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            log.warning("host %s did not take command %r", host, line)

    def supervise(self, progress: FleetProgress, broker: Broker, corruptor: Corruptor | None,
                  timeout: float) -> None:
        """Wait for every host to finish, injecting the planned faults on the way; the
        aggregator must not exit, hosts and the replayer must exit with 0."""
        plan = self.plan
        pending = {"kill": plan.kill > 0, "cut": plan.cut > 0,
                   "broker": plan.broker_restart_at >= 0}
        restart_at: dict[str, float] = {}
        deadline = Deadline(timeout, lambda: f" (progress {100 * progress.fraction:.0f} %); "
                                             f"logs in {self.procs.logs}")
        while True:
            deadline.check()
            for name in [n for n, at in restart_at.items() if time.monotonic() >= at]:
                del restart_at[name]
                self.start_host(name)
                self.events("restarted", host=name, devices=self.layout.hosts[name])
            self.procs.check(lambda name, code: name in restart_at  # killed on purpose
                             or (name != "aggregator" and code == 0))
            if not restart_at and not self.procs.running(lambda name: name in self.layout.hosts):
                return
            if pending["kill"] and progress.fraction >= plan.kill_at:
                pending["kill"] = False
                for name in self._hosts_to_kill():
                    self.procs.kill(name)
                    restart_at[name] = time.monotonic() + plan.kill_down_s
                    self.events("kill -9", host=name, devices=self.layout.hosts[name])
            if pending["cut"] and progress.fraction >= plan.cut_at:
                pending["cut"] = False
                for cid in pick(sorted(self.layout.expected), plan.cut, self.rng):
                    self.command(self.layout.host_of(cid), f"cut {cid} {plan.cut_s}")
                    self.events("link cut", device=cid, seconds=plan.cut_s)
            if pending["broker"] and progress.fraction >= plan.broker_restart_at:
                pending["broker"] = False
                self._restart_broker(broker, corruptor)
            time.sleep(0.1)

    def _hosts_to_kill(self) -> list[str]:
        """Whole hosts, chosen at random, until at least `kill` x devices are covered."""
        want = round(self.plan.kill * self.devices)
        names = list(self.layout.hosts)
        self.rng.shuffle(names)
        chosen, n = [], 0
        for name in names:
            if n >= want:
                break
            chosen.append(name)
            n += len(self.layout.hosts[name])
        return chosen

    def _restart_broker(self, broker: Broker, corruptor: Corruptor | None) -> None:
        if corruptor is not None:  # no damaged copy in flight across the restart
            corruptor.paused.set()
            corruptor.drain()
            time.sleep(0.5)
        self.events("broker restart", down_s=self.plan.broker_down_s)
        broker.restart(self.plan.broker_down_s)
        if corruptor is not None:
            time.sleep(1.0)
            corruptor.paused.clear()

    def finish(self, progress: FleetProgress) -> bool:
        """Let the aggregator take in the last messages, then stop it (it saves its state) and
        the replayer; whether the aggregator was still running."""
        last, since = None, progress.aggregator_statuses
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counters = json.dumps(progress.aggregator.get("counters", {}), sort_keys=True)
            if counters != last:
                last, since = counters, progress.aggregator_statuses
            elif progress.aggregator_statuses - since >= QUIET_STATUSES:
                break
            time.sleep(0.2)
        alive = self.procs["aggregator"].poll() is None
        self.procs.stop("aggregator", grace=30)
        replayer: Process = self.procs["replayer"]
        try:
            replayer.wait(10)
        except subprocess.TimeoutExpired:
            replayer.terminate()
        self.events("finished", progress=round(progress.fraction, 3))
        return alive
