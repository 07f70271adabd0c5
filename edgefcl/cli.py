"""The `edgefcl` command: one entry point with subcommands."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from edgefcl.config import ConfigError
from edgefcl.options import (
    BROKER_VARIABLE,
    DAEMON_HELP,
    HelpFormatter,
    Parser,
    add_command,
    add_config_flags,
    check_runs,
    config_from_args,
    daemon_config,
    env_broker,
    log_level,
    logging_options,
    run_command,
    show_all_help,
)
from edgefcl.runtime.roles import add_role_commands
from edgefcl.support.logs import setup_logging
from edgefcl.support.units import fmt_bytes
from edgefcl.version import __version__


def cmd_simulate(args: argparse.Namespace) -> int:
    from edgefcl.outcomes.report import (
        compare_table,
        finished_runs,
        run_dir,
        run_table,
        runs_replaced,
        summarize,
        why_alone,
        with_held_runs,
        write_run,
        write_summary,
    )
    from edgefcl.runner import run_many, total_runs

    cfg = config_from_args(args)
    check_runs(cfg)
    out = Path(cfg.out) if cfg.out else None
    if args.resume and out is None:
        raise ConfigError("--resume needs --out DIR (the run directory to resume)")
    if args.resume and args.overwrite:
        raise ConfigError("--resume keeps the finished runs in --out and --overwrite replaces "
                          "them: give one of them")
    several = total_runs(cfg) > 1 or bool(cfg.compare)  # --compare: the comparison layout
    if out is not None:
        from edgefcl.support.statefiles import make_dir

        make_dir(out)

    done = finished_runs(cfg, out, several) if args.resume else {}
    if done:
        print(f"resuming {out}: {len(done)} finished run(s) kept", flush=True)
    elif out is not None and not (args.overwrite or args.resume):
        replaced = runs_replaced(cfg, out, several)
        if replaced:
            print(f"{out} holds {replaced} finished run(s) of these options: this command runs "
                  "them again (--resume keeps them)", file=sys.stderr, flush=True)
    total, ran, started = total_runs(cfg), [], time.monotonic()
    todo = total - len(done)

    def finished(r) -> None:
        print(run_table(r), flush=True)
        if out is not None:
            write_run(r, run_dir(out, r) if several else out)
        ran.append(r)
        if len(ran) < todo and not cfg.quiet:  # the sweep: runs left, the time they may take
            per = (time.monotonic() - started) / len(ran)
            kept = f" ({len(done)} kept)" if done else ""
            print(f"{len(done) + len(ran)}/{total} runs done{kept}, about "
                  f"{per * (todo - len(ran)):.0f} s left", file=sys.stderr, flush=True)
    term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # (kill: as Ctrl-C)
    try:
        results = run_many(cfg, on_done=finished, done=done)
    except KeyboardInterrupt:
        if out is not None and several and done.keys() | {(r.method, r.seed) for r in ran}:
            print(f"{len(done) + len(ran)} of {total} runs finished, in {out}; the same "
                  "command with --resume runs the rest", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, term)
    if several:
        if args.resume:
            results, extra = with_held_runs(results, out)
            if extra:
                print(f"the summary keeps {len(extra)} finished run"
                      f"{'s' if len(extra) > 1 else ''} not in this sweep: {', '.join(extra)}")
        summary = write_summary(results, out) if out else summarize(results)
        print()
        print(compare_table(summary))
    if out:
        print(f"results and plots written to {out}/")
    for r in (r for r in results if r.rounds == 0):
        log.warning("the fleet never federated (rounds = 0) in %s seed %d: %s", r.method,
                    r.seed, why_alone(r))
    return 0


BENCHES = {
    "client": "per-mini-batch time split (train, perturb+score, memory), batched vs per-view "
              "scoring, cached vs full re-scoring",
    "transport": "lock-step MQTT vs in-process wall time, aggregator ingest rate (Mosquitto "
                 "and embedded broker, 1M-parameter model), aggregation memory for 10 vs 100 "
                 "updates",
    "fleet": "lightweight devices (one MQTT connection each) against Mosquitto and the "
             "aggregator daemon, vs the raw broker rate (its options below)",
    "shard": "CPU time per update of one aggregator vs an aggregator worker, and per partial "
             "of the root (dense and sparse demo updates, through the daemons' handlers)",
    "backpressure": "the backpressure control loop on a virtual clock (the daemon's inbox, "
                    "controller and update quota, the devices' pacers): synchronised, random "
                    "and bursty devices, devices that ignore the factor (table, JSON, plot)",
    "crash": "SIGKILL the aggregator at random moments and check its state after each restart",
    "fuzz": "mutated payloads through the aggregator's and the device's message handlers",
    "flood": "the aggregator process's resident memory under chunk and tensor-count floods "
             "over Mosquitto, with honest devices' rounds timed",
    "async": "the async study: rules x timing profiles x datasets x seeds in process on the "
             "virtual clock, against lock-step (A, F, worst task; table, JSON and plot)",
    "memory": "the memory study: selection rules x datasets x memory sizes x seeds (A, F as "
              "mean ± sample std, wall time per run; table, JSON and plot)",
    "batching": "whole in-process runs with the clients trained one after another and stacked "
                "(--batch-clients off / on) for each fleet size: wall time per client "
                "mini-batch, A, F (on CPU or GPU)",
}
"""Benchmark kinds of `edgefcl bench KIND`, one module each in edgefcl/bench/."""
BENCH_DEFAULTS = {"datasets": None, "async_rules": None, "profiles": None, "fleets": None,
                  "resume": False,
                  "per_class": "5,10,20,50", "jobs": 1, "repeats": 3, "count": 0,
                  "rules": "er,cbr,bi,bi:bottom@on_change,bi:top,bi:step@on_change,bi:mix,"
                           "bi:kcenter,bi:herding,bi:step+past"}
"""Every bench-specific option's default: each `bench WHAT` takes only its own."""


BENCH_HELP = {"out": "folder for the JSON, the tables and the plots (default: runs/bench)"}
"""Config fields whose meaning differs for the benches."""


def add_bench_arguments(what: str, p: argparse.ArgumentParser) -> None:
    """The options of `edgefcl bench WHAT` beyond the config flags."""
    if what in ("memory", "async"):
        p.add_argument("--datasets", help="comma-separated datasets (digits28: digits upscaled "
                       "to 28x28 images; any --dataset spec such as npz:PATH) (default: "
                       + ("digits,mnist1d,digits28)" if what == "memory" else "digits,mnist1d)"))
        p.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="runs at once, each in its own process (same results; the wall "
                       "times per run then include their contention)")
    if what == "async":
        from edgefcl.bench.async_presets import PRESETS

        p.add_argument("--async-rules", metavar="RULES",
                       help="comma-separated rules NAME[/FIELD=VALUE...], NAME one of "
                       f"{', '.join(PRESETS)} (default: lockstep and the async presets)")
        p.add_argument("--profiles", help="comma-separated timing profiles (default: "
                       "homogeneous,heterogeneous)")
    if what == "memory":
        p.add_argument("--per-class", default=BENCH_DEFAULTS["per_class"], metavar="N,N",
                       help="memory sizes in samples per class")
        p.add_argument("--rules", default=BENCH_DEFAULTS["rules"], metavar="RULES",
                       help="rules METHOD[:SELECTION][+past][@RESCORE][~SHARE] (SHARE: "
                       "equal | stream, the current task's share of the memory)")
    if what in ("client", "transport", "batching"):
        p.add_argument("--repeats", type=int, default=3, metavar="N", help="timing repeats")
    if what == "batching":
        p.add_argument("--fleets", metavar="N,N", help="comma-separated fleet sizes (client "
                       "counts) to run, e.g. 3,32 (default: --clients)")
        p.add_argument("--resume", action="store_true", help="keep the fleet sizes that "
                       "--out's bench_batching.json holds for the same configuration and run "
                       "only the others")
    if what == "backpressure":
        p.add_argument("--devices", type=int, default=1000, metavar="N",
                       help="devices in the loop")
    if what in ("crash", "fuzz", "flood"):
        what_of = {"crash": "SIGKILLs of the aggregator (default: 100)",
                   "fuzz": "mutated payloads (default: 100000)",
                   "flood": "MiB sent in each flood, in whole messages: at least one (a "
                            "tensor-count update is 49 MiB) (default: 1024)"}[what]
        p.add_argument("--count", type=int, default=0, metavar="N", help=what_of)
    if what == "fleet":
        from edgefcl.bench.loadgen.fleet_options import add_fleet_arguments

        add_fleet_arguments(p)


def cmd_bench(args: argparse.Namespace) -> int:
    from edgefcl.bench.client_speed import run_bench

    cfg = config_from_args(args)
    if args.what == "fleet":
        from edgefcl.bench.fleet import run_from_args

        return run_from_args(args, cfg, Path(cfg.out or "runs/bench"))
    if args.what == "async":
        from edgefcl.bench.async_study import run_from_args as run_async_study

        return run_async_study(args, cfg, Path(cfg.out or "runs/bench"))
    if args.what == "backpressure":
        from edgefcl.bench.backpressure_loop import Loop, bench_backpressure

        if args.devices < 1:
            raise ConfigError("--devices must be >= 1")
        bench_backpressure(Path(cfg.out or "runs/bench"), cfg.seeds,
                           Loop(devices=args.devices, capacity=float(args.devices),
                                seed=cfg.seed))
        return 0
    if args.what == "batching":
        from edgefcl.bench.batching import bench_batching, parse_fleets

        bench_batching(cfg, Path(cfg.out or "runs/bench"),
                       parse_fleets(args.fleets, cfg.fed.clients), args.repeats,
                       resume=args.resume)
        return 0
    if args.what == "shard":
        from edgefcl.bench.shard_cost import bench_shard

        bench_shard(cfg, Path(cfg.out or "runs/bench"))
        return 0
    return run_bench(args.what, cfg, Path(cfg.out or "runs/bench"), args.repeats,
                     study={"datasets": args.datasets, "per_class": args.per_class,
                            "rules": args.rules, "jobs": args.jobs}, count=args.count)


def cmd_export(args: argparse.Namespace) -> int:
    from edgefcl.learn.export import export_run

    r = export_run(args.run, args.output, args.exporter)
    print(f"exported the {r['model']} global model of {args.run} to {r['path']} "
          f"({fmt_bytes(r['bytes'])}, {r['exporter']} exporter, dynamic batch); "
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


def cmd_status(args: argparse.Namespace) -> int:
    from edgefcl.runtime.status import watch

    cfg = daemon_config(args)
    return watch(cfg, once=args.once, as_json=args.json, wait=args.wait,
                 interval=args.interval)


def cmd_report(args: argparse.Namespace) -> int:
    from edgefcl.outcomes.report import report_dir

    print(report_dir(Path(args.dir)))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    import threading

    from edgefcl.runtime.threads import stop_on_signals
    from edgefcl.transport.broker import EmbeddedBroker
    from edgefcl.transport.mqtt import parse_url

    host, port = args.host, args.port
    if env_broker() and (host is None or port is None):
        try:
            env_host, env_port, *_ = parse_url(env_broker())
        except ValueError as e:
            raise ConfigError(f"{BROKER_VARIABLE}: {e}") from None
        host, port = host or env_host, port or env_port
    stop = threading.Event()
    stop_on_signals(stop)
    with EmbeddedBroker(host or "127.0.0.1", 1883 if port is None else port) as broker:
        print(f"embedded MQTT broker (amqtt, MQTT 3.1.1) listening on {broker.url}; "
              "Ctrl-C stops it", flush=True)
        stop.wait()
    return 0


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """The `edgefcl` parser; `show_all`: every option in each command's help (--help-all)."""
    p = Parser(prog="edgefcl", description="Online federated continual learning on edge "
               "devices.", parents=[logging_options()], formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"edgefcl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = add_command(sub, "simulate", "replay a dataset as per-client streams and run the "
                 "federation in one process (or as a fleet of processes with --transport mqtt)",
                 "Run an online federated continual learning simulation: every client consumes "
                 "its one-pass stream, keeps a replay memory and takes part in rounds on the "
                 "burn-in/jump schedule. Prints a table and writes results.json, config.toml "
                 "and plots to --out (with --compare/--seeds: one folder per run, written as "
                 "soon as the run finishes).", cmd_simulate,
                 usage="%(prog)s [options]")
    s.add_argument("--resume", action="store_true",
                   help="keep the runs already finished in --out (same configuration) and run "
                   "only the others")
    s.add_argument("--overwrite", action="store_true",
                   help="replace what --out holds even if its runs have other options (without "
                   "it such an --out is refused)")
    add_config_flags(s, command="simulate", show_all=show_all)
    add_role_commands(sub, show_all)

    t = add_command(sub, "status", "show a running fleet: the aggregator and every device",
                 "A live table of the aggregator (version, rounds, active clients, updates "
                 "accepted and rejected by reason, bytes, last round, fleet accuracy) and "
                 "every device (online/offline, task, batches, version, last seen, "
                 "prequential accuracy, rejected messages), read from the retained status "
                 "topics. Refreshes on a terminal until Ctrl-C.", cmd_status,
                 usage="%(prog)s [options]")
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument("--json", action="store_true",
                   help="print one snapshot as JSON and exit (implies --once)")
    t.add_argument("--wait", type=float, default=1.5,
                   help="seconds to collect the retained statuses before the first table")
    t.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    add_config_flags(t, helps=DAEMON_HELP, sections=("mqtt",), command="status",
                     show_all=show_all)

    k = add_command(sub, "broker", "start the embedded MQTT broker (amqtt)",
                 "A pure-Python MQTT 3.1.1 broker for a laptop fleet. For production use "
                 "Mosquitto with the configuration in broker/.", cmd_broker)
    k.add_argument("--host", help="address to listen on (default: the host of "
                   f"{BROKER_VARIABLE} if set, else 127.0.0.1)")
    k.add_argument("--port", type=int, help=f"port to listen on (default: the port of "
                   f"{BROKER_VARIABLE} if set, else 1883)")

    b = add_command(sub, "bench", "benchmarks that print numbers and write JSON",
                    "Benchmarks that print a table and write JSON (to --out, default "
                    "runs/bench). `edgefcl bench WHAT --help` shows one's options.", cmd_bench,
                    usage="%(prog)s WHAT [options]")
    whats = b.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, text in BENCHES.items():
        w = add_command(whats, name, text, text[0].upper() + text[1:] + ".", cmd_bench,
                        usage="%(prog)s [options]", prog=f"edgefcl bench {name}")
        w.set_defaults(**BENCH_DEFAULTS)
        add_bench_arguments(name, w)
        add_config_flags(w, command=f"bench {name}", show_all=show_all, helps=BENCH_HELP)

    e = add_command(sub, "export", "export a run's global model as ONNX",
                 "Rebuild the final global model of a run directory (`edgefcl simulate --out "
                 "DIR`) or of an aggregator state directory and write it as one ONNX file "
                 "(eval mode, dynamic batch axis, class labels in its metadata), checked "
                 "against torch.", cmd_export)
    e.add_argument("--run", required=True, metavar="DIR",
                   help="run directory (one run) or aggregator state directory")
    e.add_argument("--output", metavar="FILE", help="ONNX file (default: DIR/model.onnx)")
    e.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript",
                   help="torchscript: fast, legacy TorchScript exporter; dynamo: torch.export")

    d = add_command(sub, "predict", "predict with an ONNX model (onnxruntime, no torch)",
                 "Serve an exported model on a device: read inputs from a .npy array "
                 "(N, *sample_shape), write the predicted classes.", cmd_predict)
    d.add_argument("--model", required=True, metavar="FILE", help="ONNX model")
    d.add_argument("--input", required=True, metavar="X.npy", help="inputs")
    d.add_argument("--output", metavar="PREDS.npy", help="write the predicted classes (int64)")
    d.add_argument("--logits", metavar="LOGITS.npy", help="also write the logits (float32)")
    d.add_argument("--labels", metavar="Y.npy", help="true labels: report the accuracy")
    d.add_argument("--threads", type=int, default=1, help="onnxruntime CPU threads")

    o = add_command(sub, "report", "tables and plots of a run or aggregator state directory",
                 "Print the results table of DIR (a run directory of `edgefcl simulate --out`, "
                 "a --compare/--seeds directory, or an aggregator --state-dir) and (re)write "
                 "its plots there.", cmd_report)
    o.add_argument("dir", metavar="DIR", help="run directory or aggregator state directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `edgefcl` with `argv` (default: the process's arguments); returns the exit code."""
    show_all, argv = show_all_help(sys.argv[1:] if argv is None else list(argv))
    args = build_parser(show_all).parse_args(argv)
    setup_logging(log_level(args), getattr(args, "log_json", False))
    return run_command(args, "edgefcl")


log = logging.getLogger("edgefcl")


if __name__ == "__main__":
    sys.exit(main())
