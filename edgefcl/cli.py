"""The `edgefcl` command: one entry point with subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from edgefcl.config import SECTIONS, ConfigError, RunConfig, apply, load_toml


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
            if isinstance(f.default, bool):
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
    return run_bench(args.what, cfg, Path(cfg.out or "runs/bench"), args.repeats)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edgefcl",
        description="Online federated continual learning on edge devices.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("simulate", help="replay a dataset as per-client streams and run the "
                       "federation in one process",
                       description="Run an online federated continual learning simulation: "
                       "every client consumes its one-pass stream, keeps a replay memory and "
                       "takes part in rounds on the burn-in/jump schedule. Prints a table and "
                       "writes results.json and plots to --out.")
    add_config_flags(s)
    s.set_defaults(func=cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks that print numbers and write JSON",
                       description="client: per-mini-batch time split (train, perturb+score, "
                       "memory) and batched vs per-view scoring, cached vs full re-scoring.")
    b.add_argument("what", choices=["client"], help="what to benchmark")
    b.add_argument("--repeats", type=int, default=3, help="timing repeats")
    add_config_flags(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from edgefcl.data.types import DataError

    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"edgefcl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgefcl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
