"""The fleet launcher: a broker, the aggregator daemon, the stream replayer and simulated
devices (several per host process), with faults injected on a plan, and a report.

Processes: `python -m edgefcl aggregator` and `python -m edgefcl replay` (the real daemons) and
`python -m firmware_sim device` hosts. A run is three steps, one module each: prepare
(fleet_prepare.py: options, configuration, data, expected streams, hosts), supervise
(fleet_supervise.py: processes, progress, faults: SIGKILL of whole host processes restarted
after `kill_down_s`, link cuts, a graceful broker restart, damaged copies of updates
(faults.Corruptor), clock skews given to the devices at start) and report (fleet_report.py).
"""

from __future__ import annotations

import json
import random
import secrets
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from edgefcl.runtime.supervisor import FleetError, FleetProgress
from firmware_sim.byzantine import Byzantine
from firmware_sim.faults import Corruptor, FaultPlan
from firmware_sim.fleet_prepare import (
    DEFAULT_CONFIG,
    DEFAULT_PROFILE,
    FleetOptions,
    fleet_config,
    prepare_fleet,
)
from firmware_sim.fleet_report import fleet_report, format_report
from firmware_sim.fleet_supervise import Broker, EventLog, FleetProcesses
from firmware_sim.profile import load_profile

__all__ = ["DEFAULT_CONFIG", "DEFAULT_PROFILE", "Fleet", "FleetError", "FleetOptions",
           "fleet_config", "format_report"]


class Fleet:
    """One fleet run in `workdir` (see the module docstring); `run()` returns the report."""

    def __init__(self, opts: FleetOptions, plan: FaultPlan, workdir: Path,
                 echo: bool = True) -> None:
        plan.validate()
        self.opts, self.plan, self.workdir = opts, plan, Path(workdir)
        self.cfg = fleet_config(opts)
        self.profiles = [load_profile(p) for p in opts.profiles]
        self.profile_paths = [Path(p).resolve() for p in opts.profiles]
        self.rng = random.Random(opts.seed)
        self.events = EventLog(echo)

    def run(self) -> dict[str, Any]:
        """Run the fleet to the end of every stream and return the report."""
        w, cfg, opts = self.workdir, self.cfg, self.opts
        for sub in ("logs", "results", "flash", "aggregator"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            broker = Broker(opts.broker, self.plan, w / "mosquitto")
            stack.callback(broker.stop)
            cfg.mqtt.broker = broker.url
            cfg.mqtt.fleet = f"fw{secrets.token_hex(3)}"
            layout = prepare_fleet(cfg, w, self.profiles, self.profile_paths, opts.per_process,
                                   self.plan.skew_s, self.rng, opts.speed_spread)
            fleet = FleetProcesses(cfg, w, layout, self.plan, opts.devices, self.events,
                                   self.rng)
            stack.callback(fleet.procs.stop_all, grace=0)
            fleet.start(opts.rate)
            progress = FleetProgress(cfg, layout.total,
                                     {c: e.count for c, e in layout.expected.items()})
            stack.callback(progress.close)
            byzantine = None
            if opts.byzantine > 0:
                period = cfg.fed.jump / opts.rate if opts.rate > 0 else 0.5
                byzantine = Byzantine(cfg, opts.byzantine, opts.attack, period=max(0.2, period),
                                      seed=opts.seed, ready=lambda: progress.fraction > 0.05)
                byzantine.start()
                stack.callback(byzantine.close)
            corruptor = None
            if self.plan.corrupt > 0:
                corruptor = Corruptor(cfg.mqtt, self.plan.corrupt, opts.seed)
                stack.callback(corruptor.close)
            self.events("started", devices=opts.devices, hosts=len(layout.hosts),
                        broker=cfg.mqtt.broker)
            fleet.supervise(progress, broker, corruptor, opts.timeout)
            if corruptor is not None:
                corruptor.drain()
            if byzantine is not None:
                byzantine.close()
            alive = fleet.finish(progress)
            report = fleet_report(w, layout, opts, self.plan, self.profiles, self.events.events,
                                  round(self.events.elapsed(), 1), corruptor, byzantine, alive)
            (w / "report.json").write_text(json.dumps(report, indent=1))
            return report
