"""Run configuration: dataclasses with defaults, loaded from TOML files and CLI flags.

Every field carries a help text; the CLI builds its flags from these dataclasses, so a TOML key
and a flag always mean the same thing (`memory_size` in TOML is `--memory-size` on the CLI).
TOML files group keys by section: `[data]`, `[learn]`, `[fed]` and top-level run keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help text (shown by `--help`)."""
    return field(default=default, metadata={"help": help, **kw})


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says what to fix."""


@dataclass
class DataConfig:
    """Which data, how it is split into tasks and clients, and how it streams."""

    dataset: str = opt(
        "digits",
        "dataset spec: digits | mnist1d | npz:PATH | embeddings:PATH | cifar10:DIR | "
        "cifar100:DIR | medmnist:PATH",
    )
    tasks: int = opt(5, "number of class-incremental tasks per client")
    classes_per_task: int = opt(0, "classes per task (0: all classes spread over the tasks)")
    split: str = opt(
        "overlap",
        "overlap: clients share the task sequence with disjoint samples; "
        "non-overlap: each client draws its own class order",
    )
    imbalance: float = opt(
        1.0, "fraction of samples kept by the last task (1.0: balanced; later tasks shrink "
        "geometrically down to this fraction)"
    )
    val_fraction: float = opt(0.1, "fraction of each client's task data held out for validation")
    test_fraction: float = opt(0.2, "test fraction when the dataset has no test split")
    batch_size: int = opt(10, "mini-batch size of the one-pass streams")
    mnist1d_samples: int = opt(4000, "number of mnist1d samples to generate")


@dataclass
class LearnConfig:
    """The online learner on each client."""

    method: str = opt(
        "bi",
        "bi | lc | ms | rc | en | ag (uncertainty-ranked class-balanced memory), "
        "er (reservoir), cbr (class-balanced random), fedavg (no memory), fedprox",
    )
    model: str = opt("auto", "auto | mlp | cnn | resnet18 (auto: from the data shape)")
    hidden: int = opt(512, "hidden units of the MLP")
    memory_size: int = opt(100, "replay memory capacity (samples) per client")
    selection: str = opt(
        "bottom", "which samples an over-quota class keeps: bottom (least uncertain), top, step"
    )
    perturbations: int = opt(
        0, "TTA views per sample (0: all 12 image augmentations, or 5 noise draws for vectors)"
    )
    noise_std: float = opt(0.1, "std of the Gaussian noise perturbation for vector data")
    rescore: str = opt(
        "on_change",
        "on_change: re-score memory only when the scoring model changed (a new global); "
        "always: re-score every candidate every batch (the paper's reference)",
    )
    score_chunk: int = opt(4096, "max perturbed samples per scoring forward pass")
    local_epochs: int = opt(3, "gradient steps per mini-batch (extra steps use an augmented copy)")
    optimizer: str = opt("adam", "adam | sgd")
    lr: float = opt(0.01, "learning rate")
    fedprox_mu: float = opt(0.01, "FedProx proximal weight (method fedprox)")
    device: str = opt("cpu", "torch device: cpu | cuda | cuda:N")
    threads: int = opt(1, "torch CPU threads per client (1 keeps runs bit-reproducible)")


@dataclass
class FedConfig:
    """Federation: clients, round schedule, aggregation."""

    clients: int = opt(3, "number of clients")
    burn_in: int = opt(4, "mini-batches of each task before a client may take part in rounds")
    jump: int = opt(2, "a client takes part every `jump` mini-batches after burn-in (q)")
    encoding: str = opt("dense", "update encoding on the wire: dense")
    aggregation: str = opt("fedavg", "fedavg (weighted by samples) | class-weighted")
    mix: float = opt(0.5, "weight of the new average against the previous global")
    min_clients: int = opt(2, "eligible updates needed to close a round")
    mode: str = opt("sync", "sync (lock-step, Algorithm 1) | async (deployment default)")
    round_timeout: float = opt(5.0, "async: seconds after which a round closes on quorum")
    max_staleness: int = opt(3, "async: drop updates based on globals this many versions old")


@dataclass
class MqttConfig:
    """How to reach the broker and which fleet to join."""

    broker: str = opt(
        "", "broker URL mqtt://HOST:PORT or mqtts://HOST:PORT (empty: start an embedded broker)"
    )
    fleet: str = opt("demo", "fleet name: topics live under <topic-root>/<fleet>/")
    topic_root: str = opt("edgefcl", "topic root")
    username: str = opt("", "MQTT username (empty: anonymous)")
    password: str = opt("", "MQTT password (prefer the EDGEFCL_MQTT_PASSWORD variable)")
    tls_ca: str = opt("", "CA certificate file: enables TLS")
    tls_cert: str = opt("", "client certificate file (mutual TLS)")
    tls_key: str = opt("", "client private key file (mutual TLS)")
    tls_insecure: bool = opt(False, "skip the broker hostname check (testing only)")
    chunk_size: int = opt(1 << 20, "payloads above this many bytes travel as verified chunks")
    max_payload: int = opt(64 << 20, "largest payload accepted, reassembled (bytes)")
    wire_dtype: str = opt("float32", "tensor dtype on the wire: float32 | float16")
    connect_timeout: float = opt(10.0, "seconds to wait for the broker at start-up")


@dataclass
class RunConfig:
    """A whole simulated run."""

    data: DataConfig = field(default_factory=DataConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    fed: FedConfig = field(default_factory=FedConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    seed: int = opt(0, "random seed (data split, class order, init, training)")
    seeds: int = opt(1, "number of seeds to run (seed, seed+1, ...); results as mean ± std")
    compare: str = opt("", "comma-separated methods to run side by side, e.g. bi,er,fedavg")
    transport: str = opt(
        "inprocess", "inprocess (one process) | mqtt (aggregator, clients and replayer as "
        "separate processes talking through a broker)"
    )
    out: str = opt("", "run directory for results.json and plots (empty: no files)")
    quiet: bool = opt(False, "no progress output")


SECTIONS = {"data": DataConfig, "learn": LearnConfig, "fed": FedConfig, "mqtt": MqttConfig}


def _coerce(cls: type, key: str, value: Any) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        raise ConfigError(f"unknown key '{key}' for [{cls.__name__}]; known: {sorted(fields)}")
    default = fields[key].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"'{key}' must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float, str)) and not isinstance(value, type(default)):
        if isinstance(default, float) and isinstance(value, int):
            return float(value)
        raise ConfigError(f"'{key}' must be {type(default).__name__}, got {value!r}")
    return value


def apply(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """Apply a nested dict (TOML layout) onto `cfg`; raises ConfigError on unknown keys/types."""
    for key, value in values.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            section = getattr(cfg, key)
            for k, v in value.items():
                setattr(section, k, _coerce(SECTIONS[key], k, v))
        else:
            setattr(cfg, key, _coerce(RunConfig, key, value))
    validate(cfg)
    return cfg


def load_toml(path: str | Path, cfg: RunConfig | None = None) -> RunConfig:
    """Load a TOML config file over the defaults (or over `cfg`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        values = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from e
    return apply(cfg or RunConfig(), values)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as a plain nested dict (for results.json and TOML round-trips)."""
    return dataclasses.asdict(cfg)


METHODS = ("bi", "lc", "ms", "rc", "en", "ag", "er", "cbr", "fedavg", "fedprox")


def validate(cfg: RunConfig) -> None:
    """Reject values that cannot work, with a message that says what to fix."""
    d, le, f = cfg.data, cfg.learn, cfg.fed
    methods = [m for m in cfg.compare.split(",") if m] or [le.method]
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"unknown method '{m}'; choose from {', '.join(METHODS)}")
    checks = [
        (d.tasks >= 1, "tasks must be >= 1"),
        (d.batch_size >= 1, "batch_size must be >= 1"),
        (0 < d.imbalance <= 1, "imbalance must be in (0, 1]"),
        (0 <= d.val_fraction < 1, "val_fraction must be in [0, 1)"),
        (0 < d.test_fraction < 1, "test_fraction must be in (0, 1)"),
        (d.split in ("overlap", "non-overlap"), "split must be overlap or non-overlap"),
        (le.memory_size >= 0, "memory_size must be >= 0"),
        (le.selection in ("bottom", "top", "step"), "selection must be bottom, top or step"),
        (le.rescore in ("on_change", "always"), "rescore must be on_change or always"),
        (le.local_epochs >= 1, "local_epochs must be >= 1"),
        (le.optimizer in ("adam", "sgd"), "optimizer must be adam or sgd"),
        (le.model in ("auto", "mlp", "cnn", "resnet18"), "model must be auto|mlp|cnn|resnet18"),
        (f.clients >= 1, "clients must be >= 1"),
        (f.burn_in >= 0, "burn_in must be >= 0"),
        (f.jump >= 1, "jump must be >= 1"),
        (0 <= f.mix <= 1, "mix must be in [0, 1]"),
        (f.min_clients >= 1, "min_clients must be >= 1"),
        (f.mode in ("sync", "async"), "mode must be sync or async"),
        (cfg.seeds >= 1, "seeds must be >= 1"),
        (cfg.transport in ("inprocess", "mqtt"), "transport must be inprocess or mqtt"),
        (cfg.mqtt.wire_dtype in ("float32", "float16"), "wire_dtype must be float32 or float16"),
        (cfg.mqtt.broker == "" or cfg.mqtt.broker.startswith(("mqtt://", "mqtts://")),
         "broker must look like mqtt://HOST:PORT or mqtts://HOST:PORT"),
        (cfg.mqtt.chunk_size >= 1024, "chunk_size must be >= 1024 bytes"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def dump_toml(cfg: RunConfig) -> str:
    """The config as TOML that `load_toml` reads back to an equal config."""
    d = to_dict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if k not in SECTIONS]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in d[section].items()]
    return "\n".join(lines) + "\n"
