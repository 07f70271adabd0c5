"""The `edgefcl` command: one entry point with subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from edgefcl import __version__
from edgefcl.config import SECTIONS, ConfigError, RunConfig, apply, load_toml
from edgefcl.errors import UserError
from edgefcl.logs import setup_logging

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
RUN_ONLY = ("seeds", "compare", "transport", "out", "quiet")
"""Run options that only `simulate` and `bench` use (several runs, a run directory)."""
DAEMON_HELP = {"broker": "broker URL mqtt://HOST:PORT or mqtts://HOST:PORT (default: [mqtt] "
               f"broker of --config, else {DEFAULT_BROKER})"}
"""Help texts of config fields whose meaning differs for the commands that join a fleet."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: MESSAGE (see PROG --help)`, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already states it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def logging_options() -> argparse.ArgumentParser:
    """-v / -q / --log-level / --log-json: accepted before or after any subcommand."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")
    g.add_argument("-q", dest="log_quiet", action="store_true", default=argparse.SUPPRESS,
                   help="log errors only")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   default=argparse.SUPPRESS,
                   help="log level (default: info for the daemons, status and broker; "
                   "warning for the others)")
    g.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS,
                   help="log one JSON object per line (for log collectors)")
    return p


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                     helps: dict[str, str] | None = None,
                     sections: tuple[str, ...] | None = None) -> None:
    """One flag per config field (`memory_size` -> `--memory-size`), grouped by section;
    fields in `skip` get no flag, `helps` replaces the help text of some fields, `sections`
    (default: all, "run" included) limits the flags to those sections."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file; flags given on the command line override it")
    groups = [("run", RunConfig)] + list(SECTIONS.items())
    helps = helps or {}
    for section, cls in groups:
        if sections is not None and section not in sections:
            continue
        group = parser.add_argument_group(f"[{section}] options" if section != "run"
                                          else "run options")
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS or f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = helps.get(f.name) or f"{f.metadata.get('help', '')} (default: {f.default})"
            dest = f"{section}.{f.name}"
            if isinstance(f.default, bool) and f.default:  # on by default: --no-X turns off
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=None, help=help_text)
            elif isinstance(f.default, bool):
                group.add_argument(flag, dest=dest, action="store_const", const=True,
                                   default=None, help=help_text)
            else:
                group.add_argument(flag, dest=dest, type=type(f.default), default=None,
                                   metavar=f.name.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    cfg = load_toml(args.config) if getattr(args, "config", None) else RunConfig()
    values: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if "." not in dest or value is None:
            continue
        section, key = dest.split(".", 1)
        if section == "run":
            values[key] = value
        else:
            values.setdefault(section, {})[key] = value
    return apply(cfg, values)


def check_runs(cfg: RunConfig) -> None:
    """Refuse, before any work starts, what would only fail later: a CUDA device on a
    machine without one (names are checked by the config against the registries)."""
    if cfg.learn.device != "cpu":

        from edgefcl.learn.client import resolve_device

        try:
            resolve_device(cfg.learn.device)
        except RuntimeError as e:
            raise ConfigError(f"--device {cfg.learn.device}: {e}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from edgefcl.report import (
        compare_table,
        finished_runs,
        run_dir,
        run_table,
        summarize,
        write_run,
        write_summary,
    )
    from edgefcl.runner import run_many, total_runs

    cfg = config_from_args(args)
    check_runs(cfg)
    out = Path(cfg.out) if cfg.out else None
    if args.resume and out is None:
        raise ConfigError("--resume needs --out DIR (the run directory to resume)")
    several = total_runs(cfg) > 1
    if out is not None:
        from edgefcl.report import make_dir

        make_dir(out)

    def finished(r) -> None:
        print(run_table(r), flush=True)
        if out is not None:
            write_run(r, run_dir(out, r) if several else out)

    done = finished_runs(cfg, out, several) if args.resume else {}
    if done:
        print(f"resuming {out}: {len(done)} finished run(s) kept", flush=True)
    results = run_many(cfg, on_done=finished, done=done)
    if several:
        summary = write_summary(results, out) if out else summarize(results)
        print()
        print(compare_table(summary))
    if out:
        print(f"results and plots written to {out}/")
    alone = sorted({f"{r.method} seed {r.seed}" for r in results if r.rounds == 0})
    if alone:
        log.warning("the fleet never federated (rounds = 0) in: %s; every client trained "
                    "alone", ", ".join(alone))
    return 0


BENCHES = {
    "client": "per-mini-batch time split (train, perturb+score, memory), batched vs per-view "
              "scoring, cached vs full re-scoring",
    "transport": "lock-step MQTT vs in-process wall time, aggregator ingest rate (Mosquitto "
                 "and embedded broker, 1M-parameter model), aggregation memory for 10 vs 100 "
                 "updates",
    "fleet": "lightweight devices (one MQTT connection each) against Mosquitto and the "
             "aggregator daemon, vs the raw broker rate (see the fleet options)",
    "shard": "CPU time per update of one aggregator vs an aggregator worker, and per partial "
             "of the root (dense and sparse demo updates, through the daemons' handlers)",
    "crash": "SIGKILL the aggregator at random moments and check its state after each restart",
    "fuzz": "mutated payloads through the aggregator's and the device's message handlers",
    "flood": "the aggregator process's resident memory under chunk and tensor-count floods "
             "over Mosquitto, with honest devices' rounds timed",
    "memory": "the memory study: selection rules x datasets x memory sizes x seeds (A, F as "
              "mean ± sample std, wall time per run; table, JSON and plot)",
}
"""Benchmark kinds of `edgefcl bench KIND` (edgefcl/bench.py; fleet: edgefcl/bench_fleet.py)."""


def cmd_bench(args: argparse.Namespace) -> int:
    from edgefcl.bench import run_bench

    cfg = config_from_args(args)
    if args.what == "fleet":
        from edgefcl.bench_fleet import run_from_args

        return run_from_args(args, cfg, Path(cfg.out or "runs/bench"))
    if args.what == "shard":
        from edgefcl.bench_shard import bench_shard

        bench_shard(cfg, Path(cfg.out or "runs/bench"))
        return 0
    return run_bench(args.what, cfg, Path(cfg.out or "runs/bench"), args.repeats,
                     study={"datasets": args.datasets, "per_class": args.per_class,
                            "rules": args.rules}, count=args.count)


def cmd_export(args: argparse.Namespace) -> int:
    from edgefcl.learn.export import export_run

    r = export_run(args.run, args.output, args.exporter)
    print(f"exported the {r['model']} global model of {args.run} to {r['path']} "
          f"({r['bytes'] / 1024:.1f} KB, {r['exporter']} exporter, dynamic batch); "
          f"max |torch - onnxruntime| logit = {r['max_abs_diff']:.2e}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from edgefcl.ondevice import predict_file  # numpy + onnxruntime only: no torch

    for flag, path in (("--output", args.output), ("--logits", args.logits)):
        if path and not Path(path).parent.is_dir():
            raise ConfigError(f"{flag}: folder {Path(path).parent} does not exist")
    r = predict_file(args.model, args.input, args.output, args.logits, args.labels,
                     args.threads)
    line = f"{r['samples']} predictions"
    if args.output:
        line += f" written to {args.output}"
    if r["accuracy"] is not None:
        line += f"; accuracy {100 * r['accuracy']:.1f} %"
    print(line)
    print("predicted classes: " + ", ".join(f"{c}: {n}" for c, n in r["classes"].items()))
    return 0


def daemon_config(args: argparse.Namespace) -> RunConfig:
    """Config for a command that connects to a broker (no embedded default)."""
    cfg = config_from_args(args)
    if not cfg.mqtt.broker:
        cfg.mqtt.broker = DEFAULT_BROKER
    return cfg


def cmd_aggregator(args: argparse.Namespace) -> int:
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
    from edgefcl.runtime.state import load_tensors

    cfg = daemon_config(args)
    check_runs(cfg)
    from edgefcl.runtime.threads import one_blas_thread

    one_blas_thread()
    if args.role != "single":
        check_shard_role(cfg, args)
    if args.role in ("worker", "site"):
        from edgefcl.runtime.shard_worker import WorkerDaemon

        group = args.share_group if args.role == "worker" else ""
        return WorkerDaemon(cfg, args.id, share_group=group, upstream=args.upstream,
                            flush_every=args.flush_every).run()
    state_dir = Path(args.state_dir or f"state/{cfg.mqtt.fleet}")
    from edgefcl.config import make_dir  # not edgefcl.report: the aggregator needs no torch

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

    kind, extra = AggregatorDaemon, {}
    if args.role == "root":
        from edgefcl.federation.admission import parse_roster
        from edgefcl.runtime.shard_root import RootDaemon

        kind, extra = RootDaemon, {"workers": parse_roster(args.worker_ids)}
    try:
        daemon = kind(cfg, initial, state_dir, exit_when_done=args.exit_when_done,
                      fresh=args.fresh, resume=args.resume, **extra)
    except StateError as e:  # waiting devices learn of it from the retained status
        announce_refusal(cfg, str(e))
        raise
    daemon.profile = fleet_profile(cfg, initial, setup.dataset if setup else None)
    daemon.evaluator = evaluator
    daemon.labels = setup.dataset.labels if setup else None
    return daemon.run()


def check_shard_role(cfg: RunConfig, args: argparse.Namespace) -> None:
    """Refuse a sharded role the configuration cannot run (one line, exit 2)."""
    from edgefcl.federation.shard import ShardError, check_shardable
    from edgefcl.transport.topics import validate_id

    try:
        check_shardable(cfg.fed)
        if args.role == "root":
            from edgefcl.federation.admission import parse_roster

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
    # a device that does not match its fleet stops here, before torch and the data load
    fleet = preflight(cfg, cid, fleet_profile(cfg))
    check_runs(cfg)
    if args.results:
        from edgefcl.report import make_dir

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
    client = make_client(cfg, setup, args.index, cfg.learn.method, cfg.seed)
    client.cid = cid
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


def cmd_status(args: argparse.Namespace) -> int:
    from edgefcl.runtime.status import watch

    cfg = daemon_config(args)
    return watch(cfg, once=args.once, as_json=args.json, wait=args.wait,
                 interval=args.interval)


def cmd_report(args: argparse.Namespace) -> int:
    from edgefcl.report import report_dir

    print(report_dir(Path(args.dir)))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    import signal
    import threading

    from edgefcl.transport.broker import EmbeddedBroker

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedBroker(args.host, args.port) as broker:
        print(f"embedded MQTT broker (amqtt, MQTT 3.1.1) listening on {broker.url}; "
              "Ctrl-C stops it", flush=True)
        stop.wait()
    return 0


def _command(sub, name: str, help: str, description: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description, parents=[logging_options()],
                       formatter_class=HelpFormatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="edgefcl", description="Online federated continual learning on edge "
               "devices.", parents=[logging_options()], formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"edgefcl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fleet_flags = {"skip": RUN_ONLY, "helps": DAEMON_HELP}

    s = _command(sub, "simulate", "replay a dataset as per-client streams and run the "
                 "federation in one process (or as a fleet of processes with --transport mqtt)",
                 "Run an online federated continual learning simulation: every client consumes "
                 "its one-pass stream, keeps a replay memory and takes part in rounds on the "
                 "burn-in/jump schedule. Prints a table and writes results.json, config.toml "
                 "and plots to --out (with --compare/--seeds: one folder per run, written as "
                 "soon as the run finishes).", cmd_simulate)
    s.add_argument("--resume", action="store_true",
                   help="keep the runs already finished in --out (same configuration) and run "
                   "only the others")
    add_config_flags(s)

    a = _command(sub, "aggregator", "run the aggregator daemon",
                 "Serve a fleet: validate updates, run the burn-in/jump round schedule, publish "
                 "the global model (retained). State (global, version, round log) is saved to "
                 "--state-dir in one transaction per round and resumed from after a restart or "
                 "crash; a state of another fleet or model, or of a finished run, is refused "
                 "(see --fresh, --resume). SIGTERM/SIGINT stop it gracefully.", cmd_aggregator)
    a.add_argument("--role", choices=("single", "root", "worker", "site"), default="single",
                   help="single: one process folds every update; root: combines the workers' "
                   "partial aggregates, owns state and schedule; worker: folds a share of the "
                   "updates (MQTT 5 shared subscription) into partials for the root; site: "
                   "folds a site broker's updates, partials go up its bridge (default: single)")
    a.add_argument("--worker-ids", default="w0,w1",
                   help="root: the worker ids it takes partials from (default: w0,w1)")
    a.add_argument("--id", default="w0", help="worker/site: this worker's id (default: w0)")
    a.add_argument("--share-group", default="aggregators",
                   help="worker: MQTT 5 shared subscription group (default: aggregators)")
    a.add_argument("--upstream", default="", metavar="URL",
                   help="worker/site: broker of the root (its global; partials go there); "
                   "default: the device broker")
    a.add_argument("--flush-every", type=float, default=0.5, metavar="S",
                   help="worker/site: send a partial this many seconds after the first update "
                   "it holds (default: 0.5)")
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

    c = _command(sub, "client", "run one device client",
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

    r = _command(sub, "replay", "replay a dataset as live per-client streams",
                 "Publish each client's one-pass stream on stream/<id>, starting when the "
                 "client is online.", cmd_replay)
    r.add_argument("--rate", type=float, default=0.0,
                   help="mini-batches per second per client (0: as fast as clients consume)")
    r.add_argument("--window", type=int, default=20,
                   help="rate 0: mini-batches in flight per client at most")
    add_config_flags(r, **fleet_flags)

    t = _command(sub, "status", "show a running fleet: the aggregator and every device",
                 "A live table of the aggregator (version, rounds, active clients, updates "
                 "accepted and rejected by reason, bytes, last round, fleet accuracy) and "
                 "every device (online/offline, task, batches, version, last seen, "
                 "prequential accuracy, rejected messages), read from the retained status "
                 "topics. Refreshes on a terminal until Ctrl-C.", cmd_status)
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument("--json", action="store_true",
                   help="print one snapshot as JSON and exit (implies --once)")
    t.add_argument("--wait", type=float, default=1.5,
                   help="seconds to collect the retained statuses before the first table")
    t.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    add_config_flags(t, helps=DAEMON_HELP, sections=("mqtt",))

    k = _command(sub, "broker", "start the embedded MQTT broker (amqtt)",
                 "A pure-Python MQTT 3.1.1 broker for a laptop fleet. For production use "
                 "Mosquitto with the configuration in broker/.", cmd_broker)
    k.add_argument("--host", default="127.0.0.1", help="address to listen on")
    k.add_argument("--port", type=int, default=1883, help="port to listen on")

    b = _command(sub, "bench", "benchmarks that print numbers and write JSON",
                 " ".join(f"{name}: {text}." for name, text in BENCHES.items()), cmd_bench)
    b.add_argument("what", choices=list(BENCHES), help="what to benchmark")
    b.add_argument("--datasets", default="digits,mnist1d,digits28",
                   help="memory: comma-separated datasets (digits28: digits upscaled to 28x28 "
                   "images; any --dataset spec such as npz:PATH) (default: %(default)s)")
    b.add_argument("--per-class", default="5,10,20,50",
                   help="memory: memory sizes in samples per class (default: %(default)s)")
    b.add_argument("--rules", default="er,cbr,bi,bi:bottom@on_change,bi:top,bi:step@on_change,"
                   "bi:mix,bi:kcenter,bi:herding,bi:step+past",
                   help="memory: rules METHOD[:SELECTION][+past][@RESCORE] (default: "
                   "%(default)s)")
    b.add_argument("--repeats", type=int, default=3, help="timing repeats (default: 3)")
    b.add_argument("--count", type=int, default=0,
                   help="crash: SIGKILLs (default 100); fuzz: payloads (default 100000); flood: "
                   "MiB offered per flood (default 1024)")
    from edgefcl.loadgen.options import add_fleet_arguments

    add_fleet_arguments(b)
    add_config_flags(b)

    e = _command(sub, "export", "export a run's global model as ONNX",
                 "Rebuild the final global model of a run directory (`edgefcl simulate --out "
                 "DIR`) or of an aggregator state directory and write it as one ONNX file "
                 "(eval mode, dynamic batch axis, class labels in its metadata), checked "
                 "against torch.", cmd_export)
    e.add_argument("--run", required=True, metavar="DIR",
                   help="run directory (one run) or aggregator state directory")
    e.add_argument("--output", metavar="FILE", help="ONNX file (default: DIR/model.onnx)")
    e.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript",
                   help="torchscript: fast, legacy TorchScript exporter; dynamo: torch.export")

    d = _command(sub, "predict", "predict with an ONNX model (onnxruntime, no torch)",
                 "Serve an exported model on a device: read inputs from a .npy array "
                 "(N, *sample_shape), write the predicted classes.", cmd_predict)
    d.add_argument("--model", required=True, metavar="FILE", help="ONNX model")
    d.add_argument("--input", required=True, metavar="X.npy", help="inputs")
    d.add_argument("--output", metavar="PREDS.npy", help="write the predicted classes (int64)")
    d.add_argument("--logits", metavar="LOGITS.npy", help="also write the logits (float32)")
    d.add_argument("--labels", metavar="Y.npy", help="true labels: report the accuracy")
    d.add_argument("--threads", type=int, default=1, help="onnxruntime CPU threads")

    o = _command(sub, "report", "tables and plots of a run or aggregator state directory",
                 "Print the results table of DIR (a run directory of `edgefcl simulate --out`, "
                 "a --compare/--seeds directory, or an aggregator --state-dir) and (re)write "
                 "its plots there.", cmd_report)
    o.add_argument("dir", metavar="DIR", help="run directory or aggregator state directory")
    return p


DAEMONS = ("aggregator", "client", "replay", "broker", "status")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


def log_level(args: argparse.Namespace) -> int:
    """--log-level, else -v (debug) / -q (errors), else info for daemons, warning otherwise."""
    if getattr(args, "log_level", None):
        return LEVELS[args.log_level]
    if getattr(args, "verbose", False):
        return logging.DEBUG
    if getattr(args, "log_quiet", False):
        return logging.ERROR
    return logging.INFO if args.command in DAEMONS else logging.WARNING


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(log_level(args), getattr(args, "log_json", False))
    return run_command(args, "edgefcl")


def run_command(args: argparse.Namespace, prog: str) -> int:
    """Run `args.func(args)`: bad input, bad data, an unreachable broker and a failed fleet
    process end with one clear line and exit code 2 (never a traceback), Ctrl-C with 130."""
    from edgefcl.data.types import DataError
    from edgefcl.transport.mqtt import TransportError

    try:
        return args.func(args)
    except (ConfigError, DataError, TransportError, UserError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def one_line(e: BaseException) -> str:
    """The message of `e` on one line."""
    return " ".join(str(e).split()) or type(e).__name__


log = logging.getLogger("edgefcl")


if __name__ == "__main__":
    sys.exit(main())
