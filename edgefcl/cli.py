"""The `edgefcl` command: one entry point with subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from edgefcl.config import SECTIONS, ConfigError, RunConfig, apply, load_toml
from edgefcl.logs import setup_logging


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per config field (`memory_size` -> `--memory-size`), grouped by section."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file; flags given on the command line override it")
    groups = [("run", RunConfig)] + list(SECTIONS.items())
    for section, cls in groups:
        group = parser.add_argument_group(f"[{section}] options" if section != "run"
                                          else "run options")
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS or f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from edgefcl.report import compare_table, run_table, write_run, write_summary
    from edgefcl.runner import run_many

    cfg = config_from_args(args)
    results = run_many(cfg)
    out = Path(cfg.out) if cfg.out else None
    if len(results) == 1:
        print(run_table(results[0]))
        if out:
            write_run(results[0], out)
    else:
        for r in results:
            print(run_table(r))
        from edgefcl.report import summarize

        summary = write_summary(results, out) if out else summarize(results)
        print()
        print(compare_table(summary))
    if out:
        print(f"results and plots written to {out}/")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from edgefcl.bench import run_bench

    cfg = config_from_args(args)
    return run_bench(args.what, cfg, Path(cfg.out or "runs/bench"), args.repeats, args.count)


def cmd_export(args: argparse.Namespace) -> int:
    from edgefcl.learn.export import export_run

    r = export_run(args.run, args.output, args.exporter)
    print(f"exported the {r['model']} global model of {args.run} to {r['path']} "
          f"({r['bytes'] / 1024:.1f} KB, {r['exporter']} exporter, dynamic batch); "
          f"max |torch - onnxruntime| logit = {r['max_abs_diff']:.2e}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from edgefcl.ondevice import predict_file  # numpy + onnxruntime only: no torch

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


DEFAULT_BROKER = "mqtt://127.0.0.1:1883"


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
    if args.initial:
        if not Path(args.initial).is_file():
            raise ConfigError(f"--initial: no such file {args.initial}")
        initial = load_tensors(Path(args.initial))
    else:
        from edgefcl.simulate import initial_global, prepare

        initial = initial_global(cfg, prepare(cfg, cfg.seed))
    state_dir = Path(args.state_dir or f"state/{cfg.mqtt.fleet}")
    daemon = AggregatorDaemon(cfg, initial, state_dir, exit_when_done=args.exit_when_done,
                              fresh=args.fresh, resume=args.resume)
    return daemon.run()


def cmd_client(args: argparse.Namespace) -> int:
    from edgefcl.runtime.device import DeviceRunner
    from edgefcl.simulate import client_stream, make_client, prepare

    cfg = daemon_config(args)
    logging.getLogger("edgefcl.client").info("starting: loading data and model")
    setup = prepare(cfg, cfg.seed)
    if not 0 <= args.index < len(setup.tasks):
        raise ConfigError(f"--index must be in [0, {len(setup.tasks)}) for {cfg.fed.clients} "
                          "clients")
    import torch

    torch.set_num_threads(cfg.learn.threads)
    client = make_client(cfg, setup, args.index, cfg.learn.method, cfg.seed)
    if args.id:
        client.cid = args.id
    source = (client_stream(cfg, setup.tasks[args.index], args.index, cfg.seed)
              if args.source == "local" else None)
    runner = DeviceRunner(cfg, client, source, None if args.no_eval else setup.tasks[args.index],
                          Path(args.results) if args.results else None)
    results = runner.run()
    acc = results.get("accuracy")
    print(f"{client.cid}: {results['batches']} batches, {results['rounds']} rounds"
          + (f", A = {acc:.1f} %" if acc is not None else ""))
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edgefcl",
        description="Online federated continual learning on edge devices.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging (daemons log at info level by default, simulate and "
                   "bench only warnings)")
    p.add_argument("--log-json", action="store_true",
                   help="log one JSON object per line (for log collectors)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("simulate", help="replay a dataset as per-client streams and run the "
                       "federation in one process",
                       description="Run an online federated continual learning simulation: "
                       "every client consumes its one-pass stream, keeps a replay memory and "
                       "takes part in rounds on the burn-in/jump schedule. Prints a table and "
                       "writes results.json and plots to --out.")
    add_config_flags(s)
    s.set_defaults(func=cmd_simulate)

    a = sub.add_parser("aggregator", help="run the aggregator daemon",
                       description="Serve a fleet: validate updates, run the burn-in/jump "
                       "round schedule, publish the global model (retained). State (global, "
                       "version, round log) is saved to --state-dir in one transaction per "
                       "round and resumed from after a restart or crash; a state of another "
                       "fleet or model, or of a finished run, is refused (see --fresh, "
                       "--resume). SIGTERM/SIGINT stop it gracefully.")
    a.add_argument("--state-dir", help="state directory (default: state/<fleet>)")
    a.add_argument("--initial", metavar="FILE.npz",
                   help="initial global model tensors (default: built from the config's model "
                   "and dataset with --seed)")
    a.add_argument("--exit-when-done", action="store_true",
                   help="exit once every client reported its stream done (the run is then "
                   "finished)")
    a.add_argument("--fresh", action="store_true",
                   help="discard the state in --state-dir and start a new run (default: off)")
    a.add_argument("--resume", action="store_true",
                   help="continue a finished run in --state-dir (default: off; an unfinished "
                   "run is always resumed)")
    add_config_flags(a)
    a.set_defaults(func=cmd_aggregator)

    c = sub.add_parser("client", help="run one device client",
                       description="A device: consumes its stream (from the broker's "
                       "stream/<id> topic or a local source), trains online, publishes updates, "
                       "merges globals, publishes its status with an 'offline' last will.")
    c.add_argument("--index", type=int, default=0,
                   help="which client's share of the dataset this device gets (0-based)")
    c.add_argument("--id", default="", help="client id (default: c<index>, e.g. c000)")
    c.add_argument("--source", choices=["mqtt", "local"], default="mqtt",
                   help="mqtt: the stream/<id> topic (fed by `edgefcl replay`); local: read "
                   "this device's share of the dataset directly")
    c.add_argument("--results", metavar="DIR", help="write <id>.json with this client's results")
    c.add_argument("--no-eval", action="store_true", help="skip test-set evaluation")
    add_config_flags(c)
    c.set_defaults(func=cmd_client)

    r = sub.add_parser("replay", help="replay a dataset as live per-client streams",
                       description="Publish each client's one-pass stream on stream/<id>, "
                       "starting when the client is online.")
    r.add_argument("--rate", type=float, default=0.0,
                   help="mini-batches per second per client (0: as fast as clients consume)")
    r.add_argument("--window", type=int, default=20,
                   help="rate 0: mini-batches in flight per client at most")
    add_config_flags(r)
    r.set_defaults(func=cmd_replay)

    k = sub.add_parser("broker", help="start the embedded MQTT broker (amqtt)",
                       description="A pure-Python MQTT 3.1.1 broker for a laptop fleet. For "
                       "production use Mosquitto with the configuration in broker/.")
    k.add_argument("--host", default="127.0.0.1", help="address to listen on")
    k.add_argument("--port", type=int, default=1883, help="port to listen on")
    k.set_defaults(func=cmd_broker)

    b = sub.add_parser("bench", help="benchmarks that print numbers and write JSON",
                       description="client: per-mini-batch time split (train, perturb+score, "
                       "memory) and batched vs per-view scoring, cached vs full re-scoring. "
                       "transport: lock-step MQTT vs in-process wall time, aggregator ingest "
                       "rate (Mosquitto and embedded broker, 1M-parameter model), aggregation "
                       "memory for 10 vs 100 updates. crash: SIGKILL the aggregator at random "
                       "moments and check its state after each restart. fuzz: mutated payloads "
                       "through the aggregator's and the device's message handlers.")
    b.add_argument("what", choices=["client", "transport", "crash", "fuzz"],
                   help="what to benchmark")
    b.add_argument("--repeats", type=int, default=3, help="timing repeats (default: 3)")
    b.add_argument("--count", type=int, default=0,
                   help="crash: SIGKILLs (default 100); fuzz: payloads (default 100000)")
    add_config_flags(b)
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser("export", help="export a run's global model as ONNX",
                       description="Rebuild the final global model of a run directory written "
                       "by `edgefcl simulate --out DIR` and write it as one ONNX file (eval "
                       "mode, dynamic batch axis), checked against torch.")
    e.add_argument("--run", required=True, metavar="DIR", help="run directory (one run)")
    e.add_argument("--output", metavar="FILE", help="ONNX file (default: DIR/model.onnx)")
    e.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript",
                   help="torchscript: fast, legacy TorchScript exporter; dynamo: torch.export")
    e.set_defaults(func=cmd_export)

    d = sub.add_parser("predict", help="predict with an ONNX model (onnxruntime, no torch)",
                       description="Serve an exported model on a device: read inputs from a "
                       ".npy array (N, *sample_shape), write the predicted classes.")
    d.add_argument("--model", required=True, metavar="FILE", help="ONNX model")
    d.add_argument("--input", required=True, metavar="X.npy", help="inputs")
    d.add_argument("--output", metavar="PREDS.npy", help="write the predicted classes (int64)")
    d.add_argument("--logits", metavar="LOGITS.npy", help="also write the logits (float32)")
    d.add_argument("--labels", metavar="Y.npy", help="true labels: report the accuracy")
    d.add_argument("--threads", type=int, default=1, help="onnxruntime CPU threads")
    d.set_defaults(func=cmd_predict)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    daemon = args.command in ("aggregator", "client", "replay", "broker")
    level = logging.DEBUG if args.verbose else logging.INFO if daemon else logging.WARNING
    setup_logging(level, args.log_json)
    return run_command(args, "edgefcl")


def run_command(args: argparse.Namespace, prog: str) -> int:
    """Run `args.func(args)`: bad input, bad data and an unreachable broker end with one clear
    line and exit code 2 (never a traceback), Ctrl-C with 130."""
    from edgefcl.data.types import DataError
    from edgefcl.transport.mqtt import TransportError

    try:
        return args.func(args)
    except (ConfigError, DataError, TransportError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
