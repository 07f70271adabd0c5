"""Options of `edgefcl bench fleet` (kept free of heavy imports: the CLI parser loads them)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from edgefcl.bench.loadgen.pacing import PACINGS
from edgefcl.config import ConfigError

DEVICES_PER_PROC = 250
GLOBALS = ("none", "every", "pull")
"""What the load generator's devices receive (`--globals`)."""


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench fleet` options (ignored by the other bench kinds)."""
    g = parser.add_argument_group("bench fleet options")
    g.add_argument("--devices", default="100", metavar="N[,N...]",
                   help="device counts to measure, one run each (default: 100)")
    g.add_argument("--workers", type=int, default=1, metavar="W",
                   help="aggregator workers (default: 1; W > 1: a root and W workers sharing "
                   "the updates over an MQTT 5 shared subscription)")
    g.add_argument("--payload", choices=["dense", "sparse"], default="dense",
                   help="update payload: the demo model's dense update, or its sparse update "
                   "at --topk (default: dense)")
    g.add_argument("--rate", type=float, default=1.0,
                   help="updates per second per device (default: 1.0)")
    g.add_argument("--duration", type=float, default=20.0,
                   help="seconds measured per phase, after a 3 s warm-up (default: 20)")
    g.add_argument("--overload", type=float, default=0.0, metavar="X",
                   help="instead of the ingest runs: measure the aggregator's capacity (the "
                   "rate it folds at the offered load, then that rate offered), then offer X "
                   "times it for --duration s with backpressure on and off (default 0: off)")
    g.add_argument("--capacity-duration", type=float, default=20.0, metavar="S",
                   help="--overload: seconds measured per capacity phase (default: 20)")
    g.add_argument("--pacing", choices=PACINGS, default="random",
                   help="first updates due at random phases or all at once; bursty: all "
                   "at once, in the first 10 s of every 40 s (default: random)")
    g.add_argument("--ignoring", type=float, default=0.0, metavar="F",
                   help="fraction of the devices that ignore the backpressure factor "
                   "(default: 0)")
    g.add_argument("--globals", choices=GLOBALS, default="none",
                   help="what each device receives: every global (as DeviceRunner), pull "
                   "(after each send, until a global lists it) or none; adds the downlink "
                   "MB/s and the broker's memory (default: none)")
    g.add_argument("--device-procs", type=int, default=0, metavar="P",
                   help=f"device processes (default 0: one per {DEVICES_PER_PROC} devices, "
                   "at least 2)")


@dataclass
class FleetOptions:
    """One `bench fleet` invocation."""

    devices: list[int]
    workers: int = 1
    payload: str = "dense"
    rate: float = 1.0
    duration: float = 20.0
    device_procs: int = 0
    overload: float = 0.0
    capacity_duration: float = 20.0
    pacing: str = "random"
    ignoring: float = 0.0
    globals: str = "none"
    warmup: float = 3.0
    """Seconds of publishing before each measured window (not a flag; tests shorten it)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FleetOptions:
        try:
            devices = [int(x) for x in str(args.devices).split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--devices must be N[,N...], got {args.devices!r}") from None
        opts = cls(devices, args.workers, args.payload, args.rate, args.duration,
                   args.device_procs, args.overload, args.capacity_duration, args.pacing,
                   args.ignoring, args.globals)
        opts.check()
        return opts

    def check(self) -> None:
        if self.workers < 1 or not self.devices or min(self.devices) < 1:
            raise ConfigError("--workers and every --devices count must be >= 1")
        if not self.rate > 0 or not self.duration > 0 or self.device_procs < 0:
            raise ConfigError("--rate and --duration must be > 0, --device-procs >= 0")
        if self.globals not in GLOBALS:
            raise ConfigError(f"--globals must be one of {', '.join(GLOBALS)}")
        if self.pacing not in PACINGS:
            raise ConfigError(f"--pacing must be one of {', '.join(PACINGS)}")
        if not 0 <= self.ignoring < 1:
            raise ConfigError(f"--ignoring must be in [0, 1), got {self.ignoring}")
        if self.overload and (self.overload < 1 or not self.capacity_duration > 0):
            raise ConfigError("--overload must be >= 1 (times the capacity), with "
                              "--capacity-duration > 0")

    def procs(self, n: int) -> int:
        return self.device_procs or max(2, math.ceil(n / DEVICES_PER_PROC))
