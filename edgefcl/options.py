"""Command-line building blocks shared by `edgefcl` (cli.py), the fleet roles
(runtime/roles.py) and `python -m firmware_sim`: the parser with one-line errors, the help
formatter, the logging options, one flag per config field, and `run_command`, which turns user
errors into one line and exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from typing import Any

from edgefcl.config import SECTIONS, ConfigError, RunConfig, apply, load_toml, validate
from edgefcl.support.errors import UserError
from edgefcl.support.logs import one_line as escaped

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
EXTRAS = {module: extra for extra, modules in {
    "train": ("torch", "sklearn", "river", "mnist1d", "onnx", "onnxscript", "tqdm",
              "threadpoolctl"),
    "onnx": ("onnxruntime",), "plots": ("matplotlib",), "broker": ("amqtt",), "ops": ("rich",),
}.items() for module in modules}
"""The installable part (pyproject's extras) that brings each optional module."""
BROKER_VARIABLE = "EDGEFCL_BROKER"
RUN_ONLY = ("seeds", "compare", "profile", "transport", "out", "quiet")
"""Run options that only `simulate` and `bench` use (several runs, a run directory)."""
DAEMON_HELP = {"broker": "broker URL mqtt://HOST:PORT or mqtts://HOST:PORT (default: the "
               f"{BROKER_VARIABLE} variable, else [mqtt] broker of --config, else "
               f"{DEFAULT_BROKER})"}
"""Help texts of config fields whose meaning differs for the commands that join a fleet."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: MESSAGE (see PROG --help)`, exit code 2,
    and no abbreviated flags (`--worker-id w1` was taken as `--worker-ids w1`, and a worker
    started as w0 beside the real one)."""

    argv: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        unknown = [a for a in self.argv if a.startswith("-")
                   and a.split("=", 1)[0] not in self._option_string_actions]
        if message.startswith("the following arguments are required") and unknown:
            message = f"unrecognized arguments: {' '.join(unknown)}; give a command first"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but an unknown flag is the error of the subcommand it was given to,
        which names that subcommand's help (given before any, it is named as unknown, not
        as a missing command)."""
        self.argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def _chosen(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost subcommand's parser that `ns` went through (self without one)."""
        parser: argparse.ArgumentParser = self
        while True:
            sub = next((a for a in parser._actions
                        if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(ns, sub.dest, None) if sub else None
            if sub is None or name not in sub.choices:
                return parser
            parser = sub.choices[name]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already states it or it has none; 100
    columns when the output is not a terminal (a terminal: its width)."""

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("width", shutil.get_terminal_size((100, 24)).columns - 2)
        kw.setdefault("max_help_position", 30)
        super().__init__(prog, **kw)

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
                   help="log errors only (progress lines: --quiet)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   default=argparse.SUPPRESS, metavar="LEVEL",
                   help="debug | info | warning | error (default: info for daemons)")
    g.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS,
                   help="log one JSON object per line (for log collectors)")
    return p


COMMON: dict[str, frozenset[str]] = {name: frozenset(fields.split()) for name, fields in {
    "simulate": "seed seeds compare profile transport out dataset tasks batch_size method "
                "memory_size model device clients burn_in jump mode encoding aggregation",
    "aggregator": "seed dataset method clients mode min_clients round_timeout encoding "
                  "aggregation roster client_timeout broker fleet username tls_ca "
                  "connect_timeout",
    "client": "seed dataset method device broker fleet username tls_ca connect_timeout",
    "replay": "seed dataset broker fleet username tls_ca connect_timeout",
    "status": "broker fleet username tls_ca connect_timeout",
    "bench client": "seed seeds out dataset method memory_size device clients batch_size",
    "bench transport": "seed out dataset method clients",
    "bench fleet": "out max_backpressure topk global_topk",
    "bench shard": "out",
    "bench backpressure": "seed seeds out",
    "bench crash": "out",
    "bench fuzz": "seed out encoding",
    "bench flood": "out",
    "bench async": "seed seeds out",
    "bench memory": "seed seeds out device",
    "bench batching": "seed seeds out dataset method memory_size model device clients "
                      "compile_step threads",
}.items()}
"""The config fields each command's `--help` shows (a bench's: those it reads); `--help-all`
shows every one."""
READS: dict[str, frozenset[str]] = {
    "replay": frozenset({"seed", "method", "head", "clients"}
                        | {f.name for section in ("data", "mqtt")
                           for f in dataclasses.fields(SECTIONS[section])}),
}
"""The config fields a command reads, where it ignores the others: its `--help-all` lists
these alone (every flag still parses, so one command line can serve every role)."""
TRUST = frozenset(("roster", "roster_cap", "sample_cap", "client_timeout", "max_seq_gap",
                   "clip_factor", "clip_norm", "max_share", "trim", "sigma_floor",
                   "max_backpressure", "sender_rate", "sender_cpu"))
"""[fed] fields that bound what one device can do: their own help group."""
GROUPS = {"run": "run", "data": "data", "learn": "learning", "fed": "federation",
          "mqtt": "transport"}
HELP_ALL = "--help-all"
METAVARS = {int: "N", float: "X", str: "TEXT"}
SHORT_HELP = {
    "dataset": "digits | mnist1d | npz:PATH | embeddings:PATH | cifar10:DIR | ... (see "
               "--help-all)",
    "method": "bi | er | cbr | fedavg | fedprox | vfcl | fedbnn | apc | ... (see --help-all)",
    "encoding": "update encoding: dense | sparse | q8 | gaussian | apc",
    "aggregation": "fedavg | class-weighted | median | trimmed-mean (dense); conflation | "
                   "fedbnn | moments (gaussian)",
    "roster": "comma-separated client ids allowed (empty: learned from the first seen)",
    "profile": "async timing on the virtual clock: homogeneous | heterogeneous | congested | "
               "trace:PATH",
    "transport": "inprocess | mqtt (every role a process, over a broker)",
    "connect_timeout": "seconds to wait for the broker at start-up",
}
"""Shorter help of some common fields for `--help`; `--help-all` gives the full text."""


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                     helps: dict[str, str] | None = None,
                     sections: tuple[str, ...] | None = None, command: str = "",
                     show_all: bool = True) -> None:
    """One flag per config field (`memory_size` -> `--memory-size`), in groups (run, data,
    learning, federation, trust, transport); fields in `skip` get no flag, `helps` replaces
    the help text of some fields, `sections` (default: all, "run" included) limits the flags
    to those sections. Unless `show_all`, the help lists only the `command`'s common fields
    (COMMON) and says how many more `--help-all` shows; every flag parses either way."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file; flags given on the command line override it")
    sections_ = [("run", RunConfig)] + list(SECTIONS.items())
    helps = helps or {}
    common, reads = COMMON.get(command), READS.get(command)
    groups: dict[str, argparse._ArgumentGroup] = {}
    hidden = 0
    for section, cls in sections_:
        if sections is not None and section not in sections:
            continue
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS or f.name in skip:
                continue
            title = "trust" if section == "fed" and f.name in TRUST else GROUPS[section]
            group = groups.get(title) or groups.setdefault(
                title, parser.add_argument_group(f"{title} options"))
            read = reads is None or f.name in reads
            shown = read and (show_all or common is None or f.name in common)
            hidden += read and not shown
            flag = "--" + f.name.replace("_", "-")
            text = helps.get(f.name) or (f.metadata.get("help", "") if show_all
                                         else SHORT_HELP.get(f.name, f.metadata.get("help")))
            if f.name not in helps and f.default != "" and not isinstance(f.default, bool):
                text += f" (default: {f.default})"
            help_text = text if shown else argparse.SUPPRESS
            dest = f"{section}.{f.name}"
            if isinstance(f.default, bool) and f.default:  # on by default: --no-X turns off
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=None, help=help_text)
            elif isinstance(f.default, bool):
                group.add_argument(flag, dest=dest, action="store_const", const=True,
                                   default=None, help=help_text)
            else:
                group.add_argument(flag, dest=dest, type=type(f.default), default=None,
                                   metavar=METAVARS[type(f.default)], help=help_text)
    if hidden:
        parser.add_argument(HELP_ALL, action="help",
                            help=f"show all options ({hidden} more) and exit")


def more(show_all: bool, text: str) -> str:
    """`text` as the help of an option that only `--help-all` lists."""
    return text if show_all else argparse.SUPPRESS


def show_all_help(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether `argv` asks for --help-all, argv with it turned into --help)."""
    if HELP_ALL not in argv:
        return False, argv
    return True, ["--help" if a == HELP_ALL else a for a in argv]


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
    method, compare = values.get("learn", {}).get("method"), values.get("compare")
    if method and compare:
        raise ConfigError(f"--method {method} and --compare {compare}: give one (--compare runs "
                          "each method it names)")
    try:
        return apply(cfg, values)
    except ConfigError as e:
        section, _, name = e.field.partition(".")
        if (values if section == "run" else values.get(section, {})).get(name) is None:
            raise
        flag = "--" + name.replace("_", "-")  # the flag given: "--memory-size must be >= 0"
        raise ConfigError(flag + str(e)[len(name):], e.field) from None


def check_runs(cfg: RunConfig) -> None:
    """Refuse, before any work starts, what would only fail later: a CUDA device on a
    machine without one (names are checked by the config against the registries); warn of
    a quorum the fleet cannot reach."""
    if cfg.fed.min_clients > cfg.fed.clients >= 2:  # (one client: it trains alone)
        logging.getLogger("edgefcl").warning(
            "--min-clients %d is more than --clients %d: no round can close, and every "
            "client will train alone", cfg.fed.min_clients, cfg.fed.clients)
    if cfg.learn.device != "cpu":

        from edgefcl.learn.learner import resolve_device

        try:
            resolve_device(cfg.learn.device)
        except RuntimeError as e:
            raise ConfigError(f"--device {cfg.learn.device}: {e}") from None


def env_broker() -> str:
    """The broker URL of the `EDGEFCL_BROKER` variable, "" when unset."""
    return os.environ.get(BROKER_VARIABLE, "").strip()


def daemon_config(args: argparse.Namespace) -> RunConfig:
    """Config for a command that connects to a broker (no embedded default). The broker is
    `--broker`, else the `EDGEFCL_BROKER` variable, else [mqtt] broker of the TOML, else
    mqtt://127.0.0.1:1883."""
    cfg = config_from_args(args)
    if getattr(args, "mqtt.broker", None) is None and env_broker():
        cfg.mqtt.broker = env_broker()
    if not cfg.mqtt.broker:
        cfg.mqtt.broker = DEFAULT_BROKER
    validate(cfg)  # the variable's URL too: checked, its credentials moved out of it
    return cfg


def add_command(sub, name: str, help: str, description: str, func,
                usage: str | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """A subcommand `name` of `sub` that runs `func(args)`, with the logging options;
    `usage` replaces argparse's list of every flag (e.g. "%(prog)s [options]"), `prog` the
    command's name in it (default: the parent's usage, then `name`)."""
    p = sub.add_parser(name, help=help, description=description, parents=[logging_options()],
                       formatter_class=HelpFormatter, usage=usage,
                       **({"prog": prog} if prog else {}))
    p.set_defaults(func=func)
    return p


DAEMONS = ("aggregator", "client", "replay", "broker")
"""Commands that log at info by default (`status` is a view: its table is its output)."""
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


def run_command(args: argparse.Namespace, prog: str) -> int:
    """Run `args.func(args)`: bad input, bad data, an unreachable broker and a failed fleet
    process end with one clear line and exit code 2 (never a traceback), Ctrl-C with 130, a
    closed output pipe quietly with 141."""
    from edgefcl.data.types import DataError
    from edgefcl.transport.transport_error import TransportError

    try:
        return args.func(args)
    except (ConfigError, DataError, TransportError, UserError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a part of edgefcl that this install left out
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"{prog}: error: {getattr(args, 'command', prog)} needs {e.name}, which this "
              f"install left out: pip install 'edgefcl[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader left; so does the output, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe closed


MAX_ERROR_CHARS = 2000
"""Characters of an error said on the terminal (it may quote a device's words)."""


def one_line(e: BaseException) -> str:
    """The message of `e` on one line, control characters escaped, cut to MAX_ERROR_CHARS."""
    return escaped(" ".join(str(e).split()))[:MAX_ERROR_CHARS] or type(e).__name__
