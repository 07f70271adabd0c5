"""`python -m firmware_sim`: run a simulated fleet (`fleet`) or a host of devices (`device`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from edgefcl.config import ConfigError
from edgefcl.options import HelpFormatter, Parser, log_level, logging_options, run_command


def _fleet(args: argparse.Namespace) -> int:
    from firmware_sim.faults import FaultPlan
    from firmware_sim.fleet import Fleet, FleetError, FleetOptions, fleet_config, format_report

    opts = FleetOptions(devices=args.devices, config=args.config, broker=args.broker,
                        per_process=args.per_process, rate=args.rate, seed=args.seed,
                        timeout=args.timeout, byzantine=args.byzantine, attack=args.attack,
                        defences=not args.no_defences, speed_spread=args.speed_spread)
    if args.profile:
        opts.profiles = [Path(p) for p in args.profile]
    plan = FaultPlan(kill=args.kill, kill_at=args.kill_at, kill_down_s=args.kill_down_s,
                     broker_restart_at=args.broker_restart_at,
                     broker_down_s=args.broker_down_s, corrupt=args.corrupt, cut=args.cut,
                     cut_at=args.cut_at, cut_s=args.cut_s, skew_s=args.skew_s)
    plan.validate()
    fleet_config(opts)  # refuse bad options before creating anything
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="firmware-sim-"))
    clean = dataclasses.replace(opts, byzantine=0)  # the baseline has no attackers
    runs = [("baseline", FaultPlan(), clean)] if args.baseline else []
    runs.append(("faults" if args.baseline else "run", plan, opts))
    reports = {}
    try:
        for name, p, o in runs:
            workdir = out / name
            if workdir.exists():
                shutil.rmtree(workdir)
            print(f"== {name}: {workdir}", flush=True)
            reports[name] = Fleet(o, p, workdir, echo=not args.quiet).run()
            print(format_report(reports[name]), flush=True)
    except FleetError as e:
        print(f"firmware_sim: fleet failed: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    final = reports[runs[-1][0]]
    if args.baseline:
        delta = final["A"] - reports["baseline"]["A"]
        final["A_fault_free"] = reports["baseline"]["A"]
        final["A_delta"] = delta
        print(f"\nA with faults {final['A']:.1f} % vs fault-free {reports['baseline']['A']:.1f} % "
              f"(difference {delta:+.1f} points)")
    (out / "report.json").write_text(json.dumps(reports, indent=1))
    print(f"report written to {out / 'report.json'}")
    failed = [k for k, ok in final["checks"].items() if not ok]
    if failed:
        print(f"firmware_sim: checks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _device(args: argparse.Namespace) -> int:
    from edgefcl.config import load_toml
    from firmware_sim.host import DeviceSpec, SkewFilter, run_host
    from firmware_sim.profile import DeviceProfile, load_profile

    for h in logging.getLogger().handlers:
        h.addFilter(SkewFilter())
    cfg = load_toml(args.config) if args.config else None
    if cfg is None:
        raise ConfigError("--config is required: the fleet's edgefcl run configuration")
    if args.broker:
        cfg.mqtt.broker = args.broker
    if not cfg.mqtt.broker:
        raise ConfigError("no broker: give --broker mqtt://HOST:PORT or [mqtt] broker")
    specs: list[DeviceSpec] = []
    if args.devices_file:
        try:
            listed = json.loads(Path(args.devices_file).read_text())
        except OSError as e:
            raise ConfigError(f"--devices-file: cannot read {args.devices_file}: "
                              f"{e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError(f"--devices-file {args.devices_file}: invalid JSON: {e}") from None
        for d in listed:
            prof = load_profile(d["profile"])
            speed = float(d.get("speed", 1.0))  # the fleet's speed spread (--speed-spread)
            prof = dataclasses.replace(prof, compute=dataclasses.replace(
                prof.compute, slowdown=prof.compute.slowdown * speed))
            specs.append(DeviceSpec(int(d["index"]), prof, float(d.get("skew_s", 0.0))))
    profile = load_profile(args.profile) if args.profile else DeviceProfile()
    specs += [DeviceSpec(k, profile, args.skew_s) for k in args.index]
    if not specs:
        raise ConfigError("no devices: give --index K (repeatable) or --devices-file FILE")
    bad = [s.index for s in specs if not 0 <= s.index < cfg.fed.clients]
    if bad:
        raise ConfigError(f"device indices {bad} out of range for [fed] clients = "
                          f"{cfg.fed.clients}")
    return run_host(cfg, specs, Path(args.state_dir),
                    Path(args.results) if args.results else None,
                    sys.stdin if args.commands else None)


def build_parser() -> argparse.ArgumentParser:
    from firmware_sim.byzantine import ATTACKS

    p = Parser(prog="python -m firmware_sim", parents=[logging_options()],
               formatter_class=HelpFormatter,
               description="Simulated edge devices running the edgefcl client inside device "
               "limits, and a fleet launcher with fault injection.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("fleet", help="run a fleet against a broker and an aggregator, inject "
                       "faults, print a report", parents=[logging_options()],
                       formatter_class=HelpFormatter)
    f.add_argument("--devices", type=int, default=20, help="number of devices")
    f.add_argument("--profile", action="append", metavar="TOML",
                   help="device profile (repeatable: assigned round-robin; default "
                   "firmware_sim/profiles/sensor-node.toml)")
    f.add_argument("--config", type=Path, help="edgefcl run configuration (default "
                   "firmware_sim/fleet.toml)")
    f.add_argument("--broker", default="mosquitto", help="'mosquitto' (start a local one, "
                   "needed for broker restarts) or mqtt://HOST:PORT")
    f.add_argument("--per-process", type=int, default=4, help="devices per host process")
    f.add_argument("--speed-spread", type=float, default=1.0,
                   help="spread the devices' compute slowdowns log-uniform over this ratio, "
                   "on top of their profiles (10: the async simulator's heterogeneous speeds; "
                   "default: 1, as the profiles say)")
    f.add_argument("--rate", type=float, default=2.0, help="stream mini-batches per second per "
                   "device (0: as fast as they consume)")
    f.add_argument("--seed", type=int, default=0, help="seed of the data split, models and "
                   "fault schedule")
    f.add_argument("--out", help="run directory (default: a temporary one)")
    f.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    f.add_argument("--baseline", action="store_true",
                   help="first run the same fleet without faults and compare A")
    f.add_argument("--quiet", action="store_true", help="no progress lines")
    z = f.add_argument_group("Byzantine devices (firmware_sim/byzantine.py)")
    z.add_argument("--byzantine", type=int, default=0,
                   help="attacker identities added to the --devices honest ones (default: 0)")
    z.add_argument("--attack", default="noise", choices=ATTACKS,
                   help="what the attackers send (default: noise)")
    z.add_argument("--no-defences", action="store_true",
                   help="turn the robust aggregation rules off (clipping, share cap, sigma "
                   "floor); the structural and admission checks stay (default: on)")
    g = f.add_argument_group("faults (progress thresholds are fractions of all streams)")
    g.add_argument("--kill", type=float, default=0.0, help="fraction of devices killed -9 "
                   "(whole host processes) and restarted")
    g.add_argument("--kill-at", type=float, default=0.3,
                   help="progress at which the devices are killed")
    g.add_argument("--kill-down-s", type=float, default=2.0,
                   help="seconds a killed host stays down before it restarts")
    g.add_argument("--broker-restart-at", type=float, default=-1.0,
                   help="restart the broker at this progress (negative: never)")
    g.add_argument("--broker-down-s", type=float, default=1.0,
                   help="seconds the broker stays down when restarted")
    g.add_argument("--corrupt", type=float, default=0.0,
                   help="fraction of updates that get a damaged copy (flipped bits or truncated)")
    g.add_argument("--cut", type=float, default=0.0, help="fraction of devices whose link is cut")
    g.add_argument("--cut-at", type=float, default=0.5,
                   help="progress at which the links are cut")
    g.add_argument("--cut-s", type=float, default=3.0, help="seconds a cut link stays down")
    g.add_argument("--skew-s", type=float, default=0.0,
                   help="device clocks are offset by up to this many seconds")
    f.set_defaults(func=_fleet)

    d = sub.add_parser("device", help="run one or more simulated devices in this process",
                       parents=[logging_options()], formatter_class=HelpFormatter)
    d.add_argument("--config", type=Path, help="edgefcl run configuration of the fleet")
    d.add_argument("--broker", help="broker URL (default: [mqtt] broker of the config)")
    d.add_argument("--profile", help="device profile for the --index devices")
    d.add_argument("--index", type=int, action="append", default=[],
                   help="which device (its share of the data; repeatable)")
    d.add_argument("--skew-s", type=float, default=0.0, help="clock skew of the --index devices")
    d.add_argument("--devices-file", help="JSON list of {index, profile, skew_s}")
    d.add_argument("--state-dir", default="flash", help="flash directory (one folder per device)")
    d.add_argument("--results", help="write <device>.json results here")
    d.add_argument("--commands", action="store_true",
                   help="read fault commands on stdin (cut <device> <s>, reboot <device>)")
    d.set_defaults(func=_device)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command = f"firmware_sim {args.command}"  # not a daemon: warnings by default
    logging.basicConfig(level=log_level(args),
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    return run_command(args, "firmware_sim")


if __name__ == "__main__":
    sys.exit(main())
