"""Prepare a firmware_sim fleet run: its options and run configuration, the data file every
process loads, the initial model, the configuration file, each device's expected stream (count
and digest), and the host processes' device lists (with clock skews and profiles). Every
profile's memory budget is checked here, before anything starts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgefcl.build import initial_global, make_client, prepare
from edgefcl.config import ConfigError, RunConfig, dump_toml, load_toml
from edgefcl.data.streams import stream_batches
from edgefcl.data.workload import client_id
from edgefcl.sim.profiles import slowdowns
from edgefcl.support.statefiles import save_tensors
from firmware_sim.byzantine import ATTACKS
from firmware_sim.device import expected_digest
from firmware_sim.faults import clock_skews
from firmware_sim.profile import DeviceProfile, check_memory_budget

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = PACKAGE_DIR / "fleet.toml"
DEFAULT_PROFILE = PACKAGE_DIR / "profiles" / "sensor-node.toml"


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
    speed_spread: float = 1.0
    """Devices' compute slowdowns spread log-uniform over this ratio, on top of their
    profiles' (`edgefcl.sim.profiles.slowdowns`, the async simulator's heterogeneous speeds:
    10); 1: as the profiles say."""
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
    if not opts.speed_spread >= 1:
        raise ConfigError("--speed-spread must be >= 1 (the slowest device's slowdown over "
                          "the fastest's)")
    if opts.per_process < 1:
        raise ConfigError("--per-process must be >= 1")
    if opts.rate < 0:
        raise ConfigError("--rate must be >= 0 (0: as fast as the devices consume)")
    return cfg


@dataclass(frozen=True)
class ExpectedStream:
    """A device's stream trained exactly once, in order: its batch count and TrainedLog digest."""

    count: int
    digest: str


@dataclass
class FleetLayout:
    """What a prepared fleet holds: the expected streams and the host processes."""

    expected: dict[str, ExpectedStream]
    """Per device id."""
    hosts: dict[str, list[str]]
    """Per host process: the ids of the devices it runs."""

    @property
    def total(self) -> int:
        """Batches in all streams."""
        return sum(e.count for e in self.expected.values())

    def host_of(self, cid: str) -> str:
        return next(h for h, devices in self.hosts.items() if cid in devices)


def prepare_fleet(cfg: RunConfig, workdir: Path, profiles: list[DeviceProfile],
                  profile_paths: list[Path], per_process: int, skew_s: float,
                  rng: random.Random, speed_spread: float = 1.0) -> FleetLayout:
    """Write the fleet's files into `workdir` (dataset.npz, initial.npz, fleet.toml,
    hosts/<host>.json); `cfg.data.dataset` is pointed at the data file."""
    setup = prepare(cfg, cfg.seed)
    ds = setup.dataset
    data = workdir / "dataset.npz"  # generated once; every process loads the same arrays
    arrays = {"x": ds.x_train, "y": ds.y_train}
    if ds.x_test is not None:
        arrays |= {"x_test": ds.x_test, "y_test": ds.y_test}
    np.savez(data, **arrays)
    cfg.data.dataset = f"npz:{data}"
    for i, prof in enumerate(profiles):  # refuse before starting: same check as boot
        k = i % cfg.fed.clients
        client = make_client(cfg, setup, k, cfg.learn.method, cfg.seed)
        check_memory_budget(prof, client, ds.sample_shape)
    save_tensors(workdir / "initial.npz", initial_global(cfg, setup))
    expected: dict[str, ExpectedStream] = {}
    for k in range(cfg.fed.clients):
        keys = [(b.task, b.index) for b in stream_batches(setup.tasks[k], cfg.data.batch_size,
                                                         cfg.seed * 1000 + k)]
        expected[client_id(k)] = ExpectedStream(len(keys), expected_digest(keys))
    (workdir / "fleet.toml").write_text(dump_toml(cfg))
    skews = clock_skews(list(expected), skew_s, rng)
    host_dir = workdir / "hosts"
    host_dir.mkdir(exist_ok=True)
    cids = list(expected)
    speeds = slowdowns(len(cids), cfg.seed, speed_spread)
    hosts: dict[str, list[str]] = {}
    for h in range(0, len(cids), per_process):
        name = f"host{h // per_process:02d}"
        group = cids[h:h + per_process]
        specs = [{"index": int(c[1:]), "skew_s": skews[c], "speed": float(speeds[int(c[1:])]),
                  "profile": str(profile_paths[int(c[1:]) % len(profiles)])} for c in group]
        (host_dir / f"{name}.json").write_text(json.dumps(specs, indent=1))
        hosts[name] = group
    return FleetLayout(expected, hosts)
