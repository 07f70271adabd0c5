"""The fleet roles `aggregator`, `client` and `replay`: their options and what each runs.

Below the CLI, so that `edgefcl` (cli.py) and the fleet launcher (launcher.py, which forks a
role per process and calls `main`) start them the same way without importing the CLI."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from edgefcl.config import ConfigError
from edgefcl.logs import setup_logging
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
    run_command,
)

log = logging.getLogger("edgefcl")


def cmd_aggregator(args: argparse.Namespace) -> int:
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
    from edgefcl.statefiles import load_tensors

    cfg = daemon_config(args)
    check_runs(cfg)
    state_dir = Path(args.state_dir or f"state/{cfg.mqtt.fleet}")
    from edgefcl.statefiles import make_dir

    make_dir(state_dir, "--state-dir")
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
    from edgefcl.runtime.fleet_results import announce_refusal
    from edgefcl.runtime.join import fleet_profile
    from edgefcl.runtime.store import StateError

    try:
        daemon = AggregatorDaemon(cfg, initial, state_dir, exit_when_done=args.exit_when_done,
                                  fresh=args.fresh, resume=args.resume)
    except StateError as e:  # waiting devices learn of it from the retained status
        announce_refusal(cfg, str(e))
        raise
    daemon.profile = fleet_profile(cfg, initial, setup.dataset if setup else None)
    daemon.evaluator = evaluator
    daemon.labels = setup.dataset.labels if setup else None
    return daemon.run()


def cmd_client(args: argparse.Namespace) -> int:
    import time

    started = time.time()
    from edgefcl.runtime.join import check_join, fleet_profile, preflight

    cfg = daemon_config(args)
    if not 0 <= args.index < cfg.fed.clients:
        raise ConfigError(f"--index must be in [0, {cfg.fed.clients}) for {cfg.fed.clients} "
                          "clients")
    cid = args.id or f"c{args.index:03d}"  # edgefcl.data.workload.client_id
    # a device that does not match its fleet stops here, before torch and the data load
    fleet = preflight(cfg, cid, fleet_profile(cfg))
    check_runs(cfg)
    if args.results:
        from edgefcl.statefiles import make_dir

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
    import torch

    from edgefcl.build import make_client
    from edgefcl.data.workload import client_stream
    from edgefcl.runtime.device import DeviceRunner

    torch.set_num_threads(cfg.learn.threads)
    client = make_client(cfg, setup, args.index, cfg.learn.method, cfg.seed, cid=cid)
    source = (client_stream(cfg, setup.tasks[args.index], args.index, cfg.seed)
              if args.source == "local" else None)
    runner = DeviceRunner(cfg, client, source, None if args.no_eval else setup.tasks[args.index],
                          Path(args.results) if args.results else None)
    runner.join_profile = profile
    runner.started = started
    results = runner.run()
    acc = results.get("accuracy")
    print(f"{client.cid}: {results['batches']} batches, {results['rounds']} rounds"
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


def add_role_commands(sub) -> None:
    """Add the `aggregator`, `client` and `replay` subcommands to `sub` (a subparsers object)."""
    fleet_flags = {"skip": RUN_ONLY, "helps": DAEMON_HELP}

    a = add_command(sub, "aggregator", "run the aggregator daemon",
                 "Serve a fleet: validate updates, run the burn-in/jump round schedule, publish "
                 "the global model (retained). State (global, version, round log) is saved to "
                 "--state-dir in one transaction per round and resumed from after a restart or "
                 "crash; a state of another fleet or model, or of a finished run, is refused "
                 "(see --fresh, --resume). SIGTERM/SIGINT stop it gracefully.", cmd_aggregator)
    a.add_argument("--state-dir", help="state directory (default: state/<fleet>)")
    a.add_argument("--initial", metavar="FILE.npz",
                   help="initial global model tensors (default: built from the config's model "
                   "and dataset with --seed)")
    a.add_argument("--exit-when-done", action="store_true",
                   help="exit once every client reported its stream done (the run is then "
                   "finished)")
    a.add_argument("--eval-data", metavar="DATASET",
                   help="evaluate every new global on the test split of this dataset spec "
                   "(like --dataset; 'config': the config's dataset) and log its accuracy per "
                   "round in rounds.jsonl")
    a.add_argument("--fresh", action="store_true",
                   help="discard the state in --state-dir and start a new run (default: off)")
    a.add_argument("--resume", action="store_true",
                   help="continue a finished run in --state-dir (default: off; an unfinished "
                   "run is always resumed)")
    add_config_flags(a, **fleet_flags)

    c = add_command(sub, "client", "run one device client",
                 "A device: checks that it matches the fleet (the aggregator's retained "
                 "config), consumes its stream (from the broker's stream/<id> topic or a local "
                 "source), trains online, publishes updates, merges globals, publishes its "
                 "status with an 'offline' last will.", cmd_client)
    c.add_argument("--index", type=int, default=0,
                   help="which client's share of the dataset this device gets (0-based)")
    c.add_argument("--id", default="", help="client id (default: c<index>, e.g. c000)")
    c.add_argument("--source", choices=["mqtt", "local"], default="mqtt",
                   help="mqtt: the stream/<id> topic (fed by `edgefcl replay`); local: read "
                   "this device's share of the dataset directly")
    c.add_argument("--results", metavar="DIR",
                   help="write DIR/<id>.json with this client's results (A, F, accuracy matrix)")
    c.add_argument("--no-eval", action="store_true", help="skip test-set evaluation")
    add_config_flags(c, **fleet_flags)

    r = add_command(sub, "replay", "replay a dataset as live per-client streams",
                 "Publish each client's one-pass stream on stream/<id>, starting when the "
                 "client is online.", cmd_replay)
    r.add_argument("--rate", type=float, default=0.0,
                   help="mini-batches per second per client (0: as fast as clients consume)")
    r.add_argument("--window", type=int, default=20,
                   help="rate 0: mini-batches in flight per client at most")
    add_config_flags(r, **fleet_flags)


def main(argv: list[str]) -> int:
    """Run one role from its command line (`client --index 0 ...`), as `edgefcl` would."""
    parser = Parser(prog="edgefcl", parents=[logging_options()])
    add_role_commands(parser.add_subparsers(dest="command", required=True, metavar="ROLE"))
    args = parser.parse_args(argv)
    setup_logging(log_level(args), getattr(args, "log_json", False))
    return run_command(args, "edgefcl")
