"""The fleet roles `aggregator`, `client` and `replay`: their options and what each runs.

Below the CLI, so that `edgefcl` (cli.py) and the fleet launcher (launcher.py, which forks a
role per process and calls `main`) start them the same way without importing the CLI."""

from __future__ import annotations

import argparse
import functools
import logging
import sqlite3
from pathlib import Path

from edgefcl.config import ConfigError, RunConfig
from edgefcl.options import (
    DAEMON_HELP,
    RUN_ONLY,
    Parser,
    add_command,
    add_config_flags,
    check_runs,
    daemon_config,
    log_level,
    logging_options,
    more,
    run_command,
    show_all_help,
)
from edgefcl.support.logs import setup_logging

log = logging.getLogger("edgefcl")


ROLE_OPTIONS = {"worker_ids": ("root",), "id": ("worker", "site"), "share_group": ("worker",),
                "upstream": ("worker", "site"), "flush_every": ("worker", "site"),
                "state_dir": ("single", "root"), "initial": ("single", "root"),
                "eval_data": ("single", "root"), "fresh": ("single", "root"),
                "resume": ("single", "root")}
"""The aggregator's options that apply to some roles only (their parser default is None, or
False: not given)."""
ROLE_DEFAULTS = {"worker_ids": "w0,w1", "id": "w0", "share_group": "aggregators",
                 "upstream": "", "flush_every": 0.5}
"""The values of the role options above that have one when not given."""


def role_options(args: argparse.Namespace) -> None:
    """Warn of each role option given to a role that ignores it (a root given --id, say),
    then fill in the defaults of those not given."""
    for name, roles in ROLE_OPTIONS.items():
        value = getattr(args, name)
        if args.role not in roles and value is not None and value is not False:
            log.warning("--%s applies to --role %s only: ignored for --role %s",
                        name.replace("_", "-"), "/".join(roles), args.role)
    for name, value in ROLE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def cmd_aggregator(args: argparse.Namespace) -> int:
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
    from edgefcl.support.statefiles import load_tensors

    cfg = daemon_config(args)
    check_runs(cfg)
    from edgefcl.runtime.threads import one_blas_thread

    one_blas_thread()
    role_options(args)
    if args.role != "single":
        check_shard_role(cfg, args)
    if args.role in ("worker", "site"):
        from edgefcl.runtime.shard_worker import WorkerDaemon

        group = args.share_group if args.role == "worker" else ""
        return WorkerDaemon(cfg, args.id, share_group=group, upstream=args.upstream,
                            flush_every=args.flush_every,
                            exit_when_done=args.exit_when_done, role=args.role).run()
    state_dir = Path(args.state_dir or f"state/{cfg.mqtt.fleet}")
    from edgefcl.support.statefiles import make_dir

    make_dir(state_dir, "--state-dir")
    from edgefcl.runtime.fleet_results import announce_refusal
    from edgefcl.runtime.store import StateError, StateStore

    if not (args.fresh or args.resume) and (why := StateStore.finished_run(state_dir)):
        announce_refusal(cfg, why)  # at once, before the model and data are built
        raise StateError(why)
    setup = None
    if args.initial:
        if not Path(args.initial).is_file():
            raise ConfigError(f"--initial: no such file {args.initial}")
        initial = load_tensors(Path(args.initial))
    else:
        from edgefcl.build import initial_global, prepare

        setup = prepare(cfg, cfg.seed)
        initial = initial_global(cfg, setup)
    evaluator = None
    if args.eval_data:
        from edgefcl.runtime.evaluation import GlobalEvaluator

        evaluator = GlobalEvaluator.from_config(cfg, args.eval_data, setup)
    from edgefcl.runtime.join import fleet_profile

    kind, extra = AggregatorDaemon, {}
    if args.role == "single":
        check_round_memory(cfg, initial)
    if args.role == "root":
        from edgefcl.federation.admission import parse_roster
        from edgefcl.runtime.shard_root import RootDaemon

        kind, extra = RootDaemon, {"workers": parse_roster(args.worker_ids)}
    try:
        try:
            daemon = kind(cfg, initial, state_dir, exit_when_done=args.exit_when_done,
                          fresh=args.fresh, resume=args.resume, **extra)
        except (OSError, sqlite3.Error) as e:  # a full disk, a read-only mount
            raise StateError(f"cannot write the state in {state_dir} ({e}); free space there "
                             "or give another --state-dir") from None
    except StateError as e:  # waiting devices learn of it from the retained status
        announce_refusal(cfg, str(e))
        raise
    daemon.profile = fleet_profile(cfg, initial, setup.dataset if setup else None)
    daemon.evaluator = evaluator
    daemon.labels = setup.dataset.labels if setup else None
    return daemon.run()


def check_round_memory(cfg: RunConfig, initial: dict) -> None:
    """Refuse an async run whose rule holds every update of a round (`round_spills` false)
    when `min_clients` updates cannot fit in `round_max_mib` (one line, exit 2)."""
    import math

    from edgefcl.federation.aggregator import round_spills
    from edgefcl.federation.heads import library_head
    from edgefcl.federation.registry import get_encoding

    fed = cfg.fed
    library = library_head(cfg)
    if fed.mode != "async" or not fed.round_max_mib or round_spills(fed, library):
        return
    per = sum(4 * int(t.size) for t in initial.values())
    per *= 2 if get_encoding(fed.encoding).bayesian else 1  # means and sigmas
    need = fed.min_clients * per
    if need > fed.round_max_mib * (1 << 20):
        raise ConfigError(
            f"aggregation {fed.aggregation} holds every update of a round: --min-clients "
            f"{fed.min_clients} x {per / 1024:.0f} KiB = {need / (1 << 20):.1f} MiB is over "
            f"--round-max-mib {fed.round_max_mib:g}; raise --round-max-mib to at least "
            f"{math.ceil(need / (1 << 20))} or lower --min-clients")


def check_shard_role(cfg: RunConfig, args: argparse.Namespace) -> None:
    """Refuse a sharded role the configuration cannot run (one line, exit 2)."""
    from edgefcl.federation.admission import parse_roster
    from edgefcl.federation.heads import library_head
    from edgefcl.federation.shard import ShardError, check_shardable
    from edgefcl.transport.topics import validate_id

    try:
        if library_head(cfg):
            raise ShardError("head prototypes does not shard yet (partials carry no prototype "
                             "library); run it with --role single")
        check_shardable(cfg.fed)
        if args.role == "root":
            if not parse_roster(args.worker_ids):
                raise ValueError("--role root needs --worker-ids ID[,ID...]")
            for w in parse_roster(args.worker_ids):
                validate_id(w, "worker id")
        else:
            validate_id(args.id, "worker id")
            if args.share_group:
                validate_id(args.share_group, "share group")
        if args.flush_every <= 0:
            raise ValueError("--flush-every must be > 0")
    except (ShardError, ValueError) as e:
        raise ConfigError(f"--role {args.role}: {e}") from None


def cmd_client(args: argparse.Namespace) -> int:
    import time

    started = time.time()
    from edgefcl.runtime.join import check_join, fleet_profile, preflight

    cfg = daemon_config(args)
    if not 0 <= args.index < cfg.fed.clients:
        raise ConfigError(f"--index must be in [0, {cfg.fed.clients}) for {cfg.fed.clients} "
                          "clients")
    cid = args.id or f"c{args.index:03d}"  # edgefcl.data.workload.client_id
    if cfg.mqtt.username and cfg.mqtt.username != cid:
        log.warning("--username %s is not this device's id %s: the shipped broker ACL lets a "
                    "device write only under its username, so give it --id %s (or name its "
                    "broker user %s)", cfg.mqtt.username, cid, cfg.mqtt.username, cid)
    # a device that does not match its fleet stops here, before torch and the data load
    fleet = preflight(cfg, cid, fleet_profile(cfg))
    check_runs(cfg)
    if args.results:
        from edgefcl.support.statefiles import make_dir

        make_dir(Path(args.results), "--results")
    logging.getLogger("edgefcl.client").info("starting: loading data and model")
    from edgefcl.build import initial_global, prepare

    setup = prepare(cfg, cfg.seed)
    if not 0 <= args.index < len(setup.tasks):
        raise ConfigError(f"--index must be in [0, {len(setup.tasks)}) for {cfg.fed.clients} "
                          "clients")
    profile = fleet_profile(cfg, initial_global(cfg, setup), setup.dataset)
    if fleet is not None:  # now the data shape and the model tensors too
        check_join(cid, cfg.mqtt.fleet, profile, fleet)

    from edgefcl.build import make_client, use_cpu_threads
    from edgefcl.data.workload import client_stream
    from edgefcl.runtime.device_runner import DeviceRunner
    from edgefcl.runtime.heap import freeze_startup_heap

    use_cpu_threads(cfg.learn.threads)
    client = make_client(cfg, setup, args.index, cfg.learn.method, cfg.seed, cid=cid)
    source = (client_stream(cfg, setup.tasks[args.index], args.index, cfg.seed)
              if args.source == "local" else None)
    runner = DeviceRunner(cfg, client, source, None if args.no_eval else setup.tasks[args.index],
                          Path(args.results) if args.results else None)
    runner.join_profile = profile
    runner.started = started
    freeze_startup_heap()  # one device per process: the model lives as long as it does
    results = runner.run()
    acc = results.get("accuracy")
    print(f"{client.cid}: {results['batches']} batches, {results['rounds']} globals merged"
          + (f", A = {acc:.1f} %" if acc is not None else "")
          + (f", F = {results['forgetting']:.1f} %" if "forgetting" in results else ""))
    if results["rounds"] == 0 and results["batches"] > 0:
        log.warning("%s never took part in a round (rounds = 0): it trained alone; check the "
                    "aggregator's log and `edgefcl status`", client.cid)
        return 1 if cfg.fed.clients >= cfg.fed.min_clients else 0
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from edgefcl.data.workload import client_id, client_stream, load_workload
    from edgefcl.runtime.replayer import Replayer

    cfg = daemon_config(args)
    work = load_workload(cfg, cfg.seed)
    streams = {client_id(k): client_stream(cfg, work.tasks[k], k, cfg.seed)
               for k in range(cfg.fed.clients)}
    sent = Replayer(cfg, streams, rate=args.rate, window=args.window).run()
    print(f"replayed {sum(sent.values())} mini-batches to {len(sent)} clients")
    return 0


def add_role_commands(sub, show_all: bool = False) -> None:
    """Add the `aggregator`, `client` and `replay` subcommands to `sub` (a subparsers object);
    `show_all`: every config flag in their help (--help-all), else their common ones."""
    fleet_flags = {"skip": RUN_ONLY, "helps": DAEMON_HELP, "show_all": show_all}

    a = add_command(sub, "aggregator", "run the aggregator daemon",
                 "Serve a fleet: validate updates, run the burn-in/jump round schedule, publish "
                 "the global model (retained). State is saved to --state-dir each round and "
                 "resumed after a restart or crash; SIGTERM/SIGINT stop it gracefully. Sharding "
                 "(--role root|worker|site): --help-all.", cmd_aggregator,
                 usage="%(prog)s [options]")
    h = functools.partial(more, show_all)  # sharding and seeding: --help-all only
    a.add_argument("--role", choices=("single", "root", "worker", "site"), default="single",
                   help=h("single: one process folds every update; root: combines the "
                          "workers' partial aggregates, owns state and schedule; worker: folds "
                          "a share of the updates (MQTT 5 shared subscription) into partials "
                          "for the root; site: folds a site broker's updates, partials go up "
                          "its bridge (default: single)"))
    a.add_argument("--worker-ids",
                   help=h("root: the worker ids it takes partials from (default: w0,w1)"))
    a.add_argument("--id", help=h("worker/site: this worker's id (default: w0)"))
    a.add_argument("--share-group",
                   help=h("worker: MQTT 5 shared subscription group (default: aggregators)"))
    a.add_argument("--upstream", metavar="URL",
                   help=h("worker/site: broker of the root (its global; partials go there), "
                          "with its own login: mqtt://USER@HOST:PORT, the password in "
                          "EDGEFCL_UPSTREAM_PASSWORD (the device broker's is never sent "
                          "there); default: the device broker"))
    a.add_argument("--flush-every", type=float, metavar="S",
                   help=h("worker/site: send a partial this many seconds after the first "
                          "update it holds (default: 0.5)"))
    a.add_argument("--state-dir", help="state directory (default: state/<fleet>)")
    a.add_argument("--initial", metavar="FILE.npz",
                   help=h("initial global model tensors (default: built from the config's "
                          "model and dataset with --seed)"))
    a.add_argument("--exit-when-done", action="store_true",
                   help="exit when every roster client is done (or one is and none was "
                   "heard for --client-timeout s), or no client came within that time; "
                   "worker/site: when its root's run finished")
    a.add_argument("--eval-data", metavar="DATASET",
                   help="evaluate every new global on this dataset's test split (a --dataset "
                   "spec; 'config': the config's) and log its accuracy in rounds.jsonl")
    a.add_argument("--fresh", action="store_true",
                   help="discard the state in --state-dir and start a new run (default: off)")
    a.add_argument("--resume", action="store_true",
                   help="continue a finished run in --state-dir (default: off; an unfinished "
                   "run is always resumed)")
    add_config_flags(a, command="aggregator", **fleet_flags)

    c = add_command(sub, "client", "run one device client",
                 "A device: checks that it matches the fleet (the aggregator's retained "
                 "config), consumes its stream (from the broker's stream/<id> topic or a local "
                 "source), trains online, publishes updates, merges globals, publishes its "
                 "status with an 'offline' last will.", cmd_client,
                 usage="%(prog)s [options]")
    c.add_argument("--index", type=int, default=0,
                   help="which client's share of the dataset this device gets (0-based)")
    c.add_argument("--id", default="", help="client id (default: c<index>, e.g. c000)")
    c.add_argument("--source", choices=["mqtt", "local"], default="mqtt",
                   help="mqtt: the stream/<id> topic (fed by `edgefcl replay`); local: read "
                   "this device's share of the dataset directly")
    c.add_argument("--results", metavar="DIR",
                   help="write DIR/<id>.json with this client's results (A, F, accuracy matrix)")
    c.add_argument("--no-eval", action="store_true", help="skip test-set evaluation")
    add_config_flags(c, command="client", **fleet_flags)

    r = add_command(sub, "replay", "replay a dataset as live per-client streams",
                 "Publish each client's one-pass stream on stream/<id>, starting when the "
                 "client is online. It reads the data options, --seed, --clients, --method, "
                 "--head and the transport options; it accepts the other config flags and "
                 "ignores them, so that one command line can serve every role.", cmd_replay,
                 usage="%(prog)s [options]")
    r.add_argument("--rate", type=float, default=0.0,
                   help="mini-batches per second per client (0: as fast as clients consume)")
    r.add_argument("--window", type=int, default=20,
                   help="rate 0: mini-batches in flight per client at most")
    add_config_flags(r, command="replay", **fleet_flags)


def main(argv: list[str]) -> int:
    """Run one role from its command line (`client --index 0 ...`), as `edgefcl` would."""
    show_all, argv = show_all_help(argv)
    parser = Parser(prog="edgefcl", parents=[logging_options()])
    add_role_commands(parser.add_subparsers(dest="command", required=True, metavar="ROLE"),
                      show_all)
    args = parser.parse_args(argv)
    setup_logging(log_level(args), getattr(args, "log_json", False))
    return run_command(args, "edgefcl")
