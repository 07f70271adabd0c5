"""Run configuration: dataclasses with defaults, loaded from TOML files and CLI flags.

Every field carries a help text; the CLI builds its flags from these dataclasses, so a TOML key
and a flag always mean the same thing (`memory_size` in TOML is `--memory-size` on the CLI).
TOML files group keys by section: `[data]`, `[learn]`, `[fed]` and top-level run keys.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from edgefcl.federation.staleness import STALENESS
from edgefcl.support.tomlfields import apply_table, coerce_field


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help text (shown by `--help`)."""
    return field(default=default, metadata={"help": help, **kw})


BN_MOMENTUM = 0.3
"""Momentum of the image models' BatchNorm running statistics. An online client takes a few
steps per mini-batch (3 by default) and learns a task from a few dozen: with PyTorch's 0.1
the statistics average over about 10 steps and lag the weights, so the eval-mode model (what
is evaluated, exported and scores the memory) is off. 0.3 averages over about one
mini-batch's steps."""


CURRENT_SHARES = ("equal", "stream")
"""How much room the current task's classes get in a class-balanced memory: `equal` (every
class an equal share at once, the classic class-balanced memory) or `stream` (at most the
current task's share of the samples offered so far, what reservoir sampling gives it in
expectation; the past tasks' classes share the rest). The option also takes `auto`
(`resolve_current_share`)."""


def resolve_current_share(share: str, memory: str | None) -> str:
    """The share a memory of policy `memory` uses: `auto` is the policy's own (its registry
    entry, `learn/memory_policies.py`: `stream` for score-ranked memories, as the memory
    study chose, meeting the bar in 6 of 9 cells against 2 for equal shares; `equal` for the
    others, so that `cbr` stays the classic class-balanced random baseline)."""
    if share != "auto":
        return share
    policy = NAMES.get("memories", {}).get(memory)
    return policy.current_share if policy is not None else "equal"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says what to fix. `field`
    ("learn.memory_size", "run.seed"; "" when no one field is at fault) is the field the
    message starts with, so that a command can name the flag or file entry that set it."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass
class DataConfig:
    """Which data, how it is split into tasks and clients, and how it streams."""

    dataset: str = opt(
        "digits",
        "dataset spec: digits | mnist1d | npz:PATH | embeddings:PATH | cifar10:DIR | "
        "cifar100:DIR | medmnist:PATH",
    )
    tasks: int = opt(5, "number of class-incremental tasks per client")
    classes_per_task: int = opt(0, "classes per task (0: the dataset's classes // tasks; "
                                "the classes left over are not used)")
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

    def __post_init__(self) -> None:
        check_data(self)


@dataclass
class LearnConfig:
    """The online learner on each client."""

    method: str = opt(
        "bi",
        "bi | lc | ms | rc | en | ag (uncertainty-ranked class-balanced memory), "
        "er (reservoir), cbr (class-balanced random), fedavg (no memory), fedprox, "
        "vfcl (Bayesian, mixture prior), fedbnn (Bayesian, likelihood product); vfcl and "
        "fedbnn keep a BI-ranked memory and imply the gaussian encoding; apc (FedWeIT "
        "decomposition, class-balanced random memory; implies the apc encoding)",
    )
    model: str = opt("auto", "auto | mlp | cnn | resnet18 (auto: from the data shape)")
    hidden: int = opt(512, "hidden units of the MLP")
    bn_momentum: float = opt(
        BN_MOMENTUM, "momentum of the image models' BatchNorm running statistics (about one "
        "mini-batch's local steps, 1/0.3; PyTorch's 0.1 lags a model that learns a task "
        "from a few dozen steps, and evaluation and scoring use those statistics)"
    )
    memory_size: int = opt(100, "replay memory capacity (samples) per client")
    selection: str = opt(
        "step", "which samples an over-quota class keeps: bottom (least uncertain, the "
        "paper's), top (most uncertain), step (evenly spaced uncertainty ranks), mix (half "
        "least uncertain, half random), kcenter (diverse in feature space), herding (kept "
        "mean closest to the class mean in feature space), random (uniform: the control)"
    )
    current_share: str = opt(
        "auto", "room of the current task's classes in a class-balanced memory: equal (every "
        "class an equal share at once), stream (at most the task's share of the samples seen "
        "so far, as reservoir sampling gives it; past tasks' classes share the rest), auto "
        "(stream for score-ranked memories such as bi's, equal for cbr)"
    )
    rank_past: bool = opt(
        False, "apply the selection rule to over-quota past-task classes too (cached scores) "
        "instead of cutting them at random"
    )
    perturbations: int = opt(
        0, "TTA views per sample (0: all 12 image augmentations, or 5 noise draws for vectors)"
    )
    noise_std: float = opt(0.1, "std of the Gaussian noise perturbation for vector data")
    rescore: str = opt(
        "never",
        "never: a sample is scored once, when its keep/drop first depends on a score; "
        "on_change: stored samples of ranked current-task classes are re-scored when the "
        "scoring model changed (a new global); always: every ranked candidate every batch "
        "(the paper's reference)",
    )
    score_overlap: bool = opt(
        True, "score a batch's candidates on a second thread while the client trains on it "
        "(once a frozen scoring snapshot exists; same results either way)"
    )
    score_process: bool = opt(
        True, "with onnxruntime scoring, build the TTA views and run the scoring snapshot in a "
        "worker process (one per client process, started with it) instead of in the client's "
        "interpreter, so the views never hold the training thread's GIL (same results)"
    )
    score_chunk: int = opt(
        0, "max perturbed samples per scoring forward pass (0: auto, 256 on CPU where smaller "
        "passes stay in cache, 4096 on CUDA)"
    )
    local_epochs: int = opt(3, "gradient steps per mini-batch (extra steps use an augmented copy)")
    optimizer: str = opt("adam", "adam | sgd")
    lr: float = opt(0.01, "learning rate")
    fedprox_mu: float = opt(0.01, "FedProx proximal weight (method fedprox)")
    apc_l1: float = opt(1e-4, "apc: L1 weight lambda1 on the masks and task-adaptive parameters")
    apc_l2: float = opt(100.0, "apc: weight lambda2 of the retroactive term (past-task weights)")
    apc_prune: float = opt(0.03, "apc: task-adaptive entries below this magnitude are pruned "
                           "(the authors prune at 1e-3 = 3 x their lr; 0.03 = 3 x lr 0.01)")
    apc_send: float = opt(0.7, "apc: fraction of units (largest masks) whose base rows are sent")
    score_source: str = opt(
        "tta", "logits of the memory scores: tta (P perturbed views), posterior (S weight "
        "samples of a Bayesian model), both (S x P)"
    )
    score_samples: int = opt(8, "posterior weight samples S for score_source posterior|both")
    eval_samples: int = opt(
        0, "test-time prediction of Bayesian models: 0 uses the mean weights, S > 0 averages "
        "the softmax over S posterior samples"
    )
    bayes_sigma: float = opt(0.05, "initial sigma of Bayesian layers converted from a model")
    lambda_p: float = opt(1.0, "weight of the prior term (KL or mixture prior) of Bayesian "
                          "objectives (VFCL lambda_p)")
    lambda_k: float = opt(0.5, "vfcl: weight of the global posterior in the mixture prior "
                          "(1 - lambda_k: the client's own history)")
    vfcl_samples: int = opt(1, "vfcl: Monte Carlo samples n of the mixture-prior term")
    kl_scale: str = opt(
        "params", "normaliser of the prior term: params (mean over the weights, as the FedBNN "
        "reference code) | samples (per sample of the current task seen so far: the ELBO per "
        "sample; the prior dominates on small streams)"
    )
    device: str = opt("cpu", "torch device: cpu | cuda | cuda:N")
    threads: int = opt(1, "CPU threads of torch and numpy's BLAS per client process (1 keeps runs "
                       "bit-reproducible)")
    batch_clients: str = opt(
        "auto", "in-process runs: the clients that learn a mini-batch in the same lock-step "
        "tick (async: every device whose next event is a mini-batch) train as one stacked "
        "computation (same draws; equal to training one after another within float "
        "tolerance): on | off | auto (on with CUDA, where a step is launch-bound; off on CPU, "
        "which keeps runs bit-identical to the networked runtime)"
    )
    compile_step: str = opt(
        "auto", "compile a client's training loss with torch.compile, for its steady step "
        "shapes (others run eager): on | off | auto (on with CUDA, where it captures the step "
        "as CUDA graphs; off on CPU, where it measured slower for small models)"
    )
    prequential: bool = opt(
        True, "count test-then-train accuracy on the stream (one eval forward per batch "
        "before training on it)"
    )
    task_free: bool = opt(
        False, "ignore the stream's task ids: a drift detector (ADWIN) on drift_signal opens "
        "a new task segment when the stream shifts (evaluation still uses the true tasks)"
    )
    drift_signal: str = opt(
        "loss", "task-free signal: loss (per-sample loss before training) | features "
        "(distance of each input to its nearest recent input)"
    )
    drift_delta: float = opt(
        0.0, "ADWIN confidence of the task-free detector (0: 0.002 for loss, 0.05 for features)"
    )
    score_backend: str = opt(
        "auto", "TTA scoring forward passes: torch | onnxruntime (CPU; the scoring snapshot is "
        "exported once and refilled with its weights at each global model) | auto (onnxruntime on "
        "the CPU with score_source tta, else torch)"
    )
    head: str = opt(
        "auto", "classifier: fixed (an output layer sized from the dataset's classes) | "
        "prototypes (FedBNN's prototype library: rows keyed by label name, classes may appear "
        "at run time) | auto (prototypes for fedbnn as in the paper, fixed otherwise)"
    )
    warmup_steps: int = opt(
        3, "prototypes: steps on a batch that brings a new label, extractor frozen, before "
        "regular training"
    )
    prototypes_local: bool = opt(
        False, "prototypes: keep the library on the device (updates carry the extractor only; "
        "no label leaves the device)"
    )
    export_onnx: str = opt(
        "", "after every global model write the live model as ONNX to this path ({cid} is "
        "replaced by the client id; empty: no export)"
    )


    def __post_init__(self) -> None:
        check_learn(self)

@dataclass
class FedConfig:
    """Federation: clients, round schedule, aggregation."""

    clients: int = opt(3, "number of clients")
    burn_in: int = opt(4, "mini-batches of each task before a client may take part in rounds")
    jump: int = opt(2, "a client takes part every `jump` mini-batches after burn-in (q)")
    encoding: str = opt(
        "dense", "update encoding on the wire: dense | gaussian (mu and sigma of Bayesian "
        "layers; the model is converted to a Bayesian one) | sparse (top-k of the delta to the "
        "last global, error feedback) | apc (FedWeIT decomposition; implied by method apc) | "
        "q8 (8-bit per-tensor affine quantisation of the dense update); the registry is "
        "edgefcl.federation.registry"
    )
    aggregation: str = opt(
        "fedavg", "dense and q8: fedavg (weighted by samples) | class-weighted | median | "
        "trimmed-mean (coordinate-wise, robust); sparse, apc: fedavg; gaussian: conflation "
        "(product, VFCL) | fedbnn (prior times likelihoods) | moments (moment matching)"
    )
    bnn_init_rounds: int = opt(
        0, "gaussian/fedbnn: global versions trained as a standard network (FedAvg of the "
        "means) before the Bayesian phase (FedBNN r_init)"
    )
    mix: float = opt(0.5, "weight of the new average against the previous global")
    min_clients: int = opt(2, "eligible updates needed to close a round")
    mode: str = opt("sync", "sync (lock-step, Algorithm 1) | async (what a deployed fleet "
                    "should run: examples/fleet.toml sets it)")
    round_timeout: float = opt(5.0, "async: seconds after which a round closes on quorum")
    quorum: float = opt(0.5, "async: share of the active clients whose updates a round needs "
                        "to close at round_timeout (0: min_clients alone), so that a few "
                        "clients that report first cannot own a round")
    max_staleness: int = opt(3, "async: drop updates based on globals this many versions old")
    round_max_mib: float = opt(64.0, "async: a round also closes as soon as the updates it "
                               "holds reach this many MiB (a FedBuff-style buffer that bounds "
                               "the aggregator's memory under load; 0: no bound)")
    buffer: int = opt(0, "async: a round also closes once this many updates came in, newer "
                      "ones of a client that replaced its older included, from the quorum's "
                      "share of the active clients or this many clients, whichever is fewer "
                      "(FedBuff's K; 0: half the active clients once 100 or more are active, "
                      "else off; -1: off)")
    fold: str = opt("model", "async: what a round averages: model (the models as sent, the "
                    "paper's rule) | delta (each update's change since the global it was trained "
                    "from, applied to the current global: FedBuff; mix is the server learning "
                    "rate); the registry is edgefcl.federation.folds")
    staleness: str = opt("constant", "weight of an update based on a global tau versions old, "
                         "in its round and in the round's mix: constant | polynomial "
                         "((1+tau)^-a) | hinge (1 up to b, then 1/(a(tau-b)+1)) (FedAsync)")
    staleness_a: float = opt(0.5, "the staleness rule's a")
    staleness_b: float = opt(4.0, "the staleness rule's b (hinge)")
    task_decay: float = opt(1.0, "async: an update whose sender is k tasks behind the round's "
                            "newest weighs task_decay^k (devices at different speeds are on "
                            "different tasks when the task gate is off or times out; 1: off, "
                            "the default since the task gate: docs/async.md)")
    task_gate: float = opt(60.0, "async: at the end of a task a device waits up to this many "
                           "seconds for every active device to finish that task too, so that "
                           "devices of different speeds stay on one task (0: off; "
                           "docs/async.md)")
    in_flight: int = opt(4, "async: states of its last updates sent that a device keeps until "
                         "a global holds them, so that a global holding an older one keeps the "
                         "progress made since it (each costs a copy of the model; 0: off, such "
                         "a global is merged by device_merge; docs/async.md)")
    gate_carry_mib: float = opt(16.0, "async, task gate: MiB of each device's newest update "
                                "kept so that the gate's round holds every device's end-of-task "
                                "model, those an earlier round counted too (0: off; "
                                "docs/async.md)")
    device_merge: str = opt("replace", "async: how a device merges a global it took part in: "
                            "replace (theta_global; the default from docs/async.md) | delta "
                            "(theta_global + theta_now - theta_sent) | staleness (theta_global "
                            "+ s(tau) (theta_now - theta_sent), tau: versions the global moved "
                            "on since the update's base); the registry is edgefcl.learn.merges")
    max_backpressure: float = opt(8.0, "async: the most an overloaded aggregator stretches its "
                                  "devices' jump (backpressure factor on the retained config "
                                  "and status; 1: off)")
    topk: float = opt(0.1, "sparse: fraction of each tensor's entries sent (largest deltas; "
                      "0: no cap, use threshold)")
    threshold: float = opt(0.0, "sparse: send only entries whose |delta| is at least this")
    value_dtype: str = opt("auto", "sparse/apc: dtype of the values sent: float32 | float16 | "
                           "bfloat16 (sparse only) | auto (sparse: float16 below topk 1, else "
                           "float32; apc: float32); the rounding goes into the residual")
    index_format: str = opt("auto", "sparse: index format of each tensor: auto (the cheapest "
                            "per tensor) | idx (gaps) | bits (bitmap) | zidx | zbits (zlib)")
    downlink: str = opt("auto", "globals to clients: dense (whole) | sparse (only the entries "
                        "changed since the version the client holds) | pull (async: whole, "
                        "and a device listens for globals only while an update of its waits "
                        "to be counted) | auto (sparse for the sparse and apc encodings and with "
                        "global_topk, pull for an async fleet of 100 clients or more, else "
                        "dense)")
    global_topk: float = opt(0.0, "fraction of each large tensor's entries a new global "
                             "changes: the largest changes, the rest kept on the aggregator and "
                             "sent in later versions; with a delta downlink a device receives "
                             "about that share of the model per version (0: every entry)")
    apc_kb_size: int = opt(5, "apc: task-adaptive tensors in the knowledge base the server "
                           "broadcasts")
    roster: str = opt("", "comma-separated client ids allowed to take part (empty: learned from "
                      "the first clients seen, up to roster_cap)")
    roster_cap: int = opt(0, "most clients a learned roster admits (0: clients)")
    client_timeout: float = opt(120.0, "seconds after which a silent client leaves the active "
                                "set (0: never)")
    max_seq_gap: int = opt(100_000, "largest step of a client's sequence number (also from 0)")
    sample_cap: int = opt(0, "largest num_samples one update may claim (0: batch x batch_size)")
    clip_factor: float = opt(3.0, "dense, sparse, Gaussian means and prototype rows: clip each "
                             "update's change (each row's change) at this times the round's "
                             "median change norm (of two: the smaller); moments: bound each "
                             "sigma at this times the round's median (0: off)")
    clip_norm: float = opt(0.0, "dense: clip deltas at this fixed L2 norm instead (0: adaptive)")
    sender_rate: float = opt(50.0, "messages a second one device may have handled, in bursts "
                             "of up to 2 s of them; more are shed and its status names it as "
                             "flooding (0: no limit)")
    sender_cpu: float = opt(0.05, "share of the main loop's time handling (decoding and "
                            "checking) one device's messages may take, in bursts of up to 2 s "
                            "of it; beyond it the device is served only when no device within "
                            "its share waits (0: no limit). It depends on the host and the "
                            "model: 0.05 is 5-7 dense ResNet-18 updates (4.4 MB) a second on a "
                            "2-core EPYC")
    max_share: float = opt(0.0, "largest share of a round's sample weight one client may have "
                           "(0: 2 / participants, at most 0.5; 1: off)")
    trim: float = opt(0.2, "trimmed-mean: fraction of values dropped at each end per entry")
    sigma_floor: float = opt(0.5, "gaussian: raise each sigma to at least this times the "
                             "round's median sigma of that entry (0: off)")


    def __post_init__(self) -> None:
        check_fed(self)

@dataclass
class MqttConfig:
    """How to reach the broker and which fleet to join."""

    broker: str = opt(
        "", "broker URL mqtt://HOST:PORT or mqtts://HOST:PORT (empty: start an embedded broker)"
    )
    fleet: str = opt("demo", "fleet name: topics live under <topic-root>/<fleet>/")
    topic_root: str = opt("edgefcl", "topic root")
    username: str = opt("", "MQTT username (empty: anonymous; password: EDGEFCL_MQTT_PASSWORD)")
    password: str = opt("", "MQTT password (prefer the EDGEFCL_MQTT_PASSWORD variable)")
    tls_ca: str = opt("", "CA certificate file: enables TLS")
    tls_cert: str = opt("", "client certificate file (mutual TLS)")
    tls_key: str = opt("", "client private key file (mutual TLS)")
    tls_no_verify: bool = opt(False, "do not verify the broker's certificate at all: anyone "
                              "on the path can pose as the broker (tests only)")
    tls_no_hostname_check: bool = opt(False, "accept a valid broker certificate issued for "
                                      "another host name")
    chunk_size: int = opt(1 << 20, "payloads above this many bytes travel as verified chunks")
    max_payload: int = opt(0, "largest payload accepted, reassembled (bytes; 0: sized from the "
                           "model: 4 x its float32 tensors, the apc knowledge base, the largest "
                           "prototype library and 1 MiB; 64 MiB where no model is known)")
    wire_dtype: str = opt("float32", "tensor dtype on the wire: float32 | float16")
    connect_timeout: float = opt(10.0, "seconds to wait for the broker at start-up")

    def __post_init__(self) -> None:
        settle_mqtt(self)
        check_mqtt(self)


@dataclass
class RunConfig:
    """A whole simulated run."""

    data: DataConfig = field(default_factory=DataConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    fed: FedConfig = field(default_factory=FedConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    seed: int = opt(0, "random seed (data split, class order, init, training)")
    seeds: int = opt(1, "number of seeds to run (seed, seed+1, ...); results as mean ± std")
    compare: str = opt("", "comma-separated methods to run side by side, e.g. bi,er,fedavg; "
                       "an entry METHOD+ENCODING/AGGREGATION also sets those, e.g. "
                       "bi+gaussian/conflation")
    profile: str = opt(
        "homogeneous", "async in process: the devices' timing on the virtual clock: "
        "homogeneous | heterogeneous (10x spread of speeds, lognormal delays, 3 %% dropouts) | "
        "congested (answers slower than a tiny task) | trace:PATH (a JSON trace; an MQTT "
        "run keeps its matched trace in its results.json: trace:DIR/results.json)"
    )
    transport: str = opt(
        "inprocess", "inprocess (one process) | mqtt (aggregator, clients and replayer as "
        "separate processes talking through a broker)"
    )
    out: str = opt("", "run directory for results.json and plots (empty: no files)")
    quiet: bool = opt(False, "no progress output")

    def __post_init__(self) -> None:
        validate(self)


SCORE_BACKENDS = ("auto", "torch", "onnxruntime")


def scores_with_onnxruntime(learn: LearnConfig) -> bool:
    """Whether TTA scoring runs on onnxruntime: score_backend onnxruntime, or auto on the CPU
    with score_source tta."""
    if learn.score_backend == "auto":
        return learn.device == "cpu" and learn.score_source == "tta"
    return learn.score_backend == "onnxruntime"


SECTIONS = {"data": DataConfig, "learn": LearnConfig, "fed": FedConfig, "mqtt": MqttConfig}


def apply(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """Apply a nested dict (TOML layout) onto `cfg`; raises ConfigError on unknown keys/types."""
    for key, value in values.items():
        if key in SECTIONS:
            apply_table(getattr(cfg, key), key, value, ConfigError)
        else:
            setattr(cfg, key, coerce_field(RunConfig, key, value, "", ConfigError))
    if not cfg.compare:  # vfcl / fedbnn imply the gaussian encoding
        cfg.fed = resolve_fed(cfg.learn.method, cfg.fed)
    validate(cfg)
    return cfg


def read_toml(path: str | Path, what: str = "config file",
              error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The tables of a TOML file; `error` says what is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p}: invalid TOML: {e}") from e


def load_toml(path: str | Path, cfg: RunConfig | None = None) -> RunConfig:
    """Load a TOML config file over the defaults (or over `cfg`); an error names the file."""
    values = read_toml(path)
    try:
        return apply(cfg or RunConfig(), values)
    except ConfigError as e:
        section, _, name = e.field.partition(".")
        msg = str(e)
        if section in SECTIONS:  # "memory_size in [learn] must be >= 0"
            msg = f"{name} in [{section}]{msg[len(name):]}"
        raise ConfigError(f"{path}: {msg}", e.field) from e


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as a plain nested dict (for results.json and TOML round-trips)."""
    return dataclasses.asdict(cfg)


NAMES: dict[str, Mapping[str, Any]] = {}
"""The registries a config's names are checked against, put here by their own modules when
they are imported: `learn.methods` ("methods"), `federation.registry` ("encodings"),
`federation.heads` ("heads"). The package imports them (`edgefcl/__init__.py`), so they are
here before any config is checked, and this module imports nothing above it."""


def _registries() -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(methods, encodings), as their modules registered them."""
    return NAMES["methods"], NAMES["encodings"]


def parse_entry(entry: str) -> tuple[str, str | None, str | None]:
    """A --compare entry 'METHOD[+ENCODING[/AGGREGATION]]' -> (method, encoding, aggregation);
    e.g. 'bi+gaussian/conflation' -> ('bi', 'gaussian', 'conflation'), 'bi' -> ('bi', None,
    None)."""
    method, _, rest = entry.strip().partition("+")
    encoding, _, aggregation = rest.partition("/")
    if not method or ("+" in entry and not encoding):
        raise ConfigError(f"cannot read compare entry '{entry}'; write METHOD, "
                          "METHOD+ENCODING or METHOD+ENCODING/AGGREGATION")
    return method, encoding or None, aggregation or None


def resolve_fed(method: str, fed: FedConfig, encoding: str | None = None,
                aggregation: str | None = None) -> FedConfig:
    """The federation config a run of `method` uses: explicit encoding/aggregation first; a
    method that needs an encoding (vfcl, fedbnn: gaussian; apc: apc) implies it over the
    default dense; an aggregation left at the default fedavg that the encoding does not offer
    becomes the method's (fedbnn) or the encoding's default (conflation)."""
    methods, encodings = _registries()
    m = methods.get(method)
    enc = encoding or fed.encoding
    if encoding is None and m is not None and m.encoding and enc == FedConfig.encoding:
        enc = m.encoding
    agg = aggregation or fed.aggregation
    e = encodings.get(enc)
    if (aggregation is None and e is not None and agg == FedConfig.aggregation
            and agg not in e.rules):
        agg = m.aggregation if m is not None and m.aggregation else e.default_rule
    if (enc, agg) == (fed.encoding, fed.aggregation):
        return fed
    return dataclasses.replace(fed, encoding=enc, aggregation=agg)


def run_entries(cfg: RunConfig) -> list[tuple[str, str, FedConfig]]:
    """(label, method, federation config) of every run of `--compare` (or `--method`)."""
    entries = [e.strip() for e in cfg.compare.split(",") if e.strip()] or [cfg.learn.method]
    twice = next((e for i, e in enumerate(entries) if e in entries[:i]), None)
    if twice is not None:  # its runs would count twice in the mean and its std
        raise ConfigError(f"--compare names {twice} twice; name each method once")
    out = []
    for e in entries:
        method, enc, agg = parse_entry(e)
        out.append((e, method, resolve_fed(method, cfg.fed, enc, agg)))
    return out


def resolve_head(head: str, method: str) -> str:
    """The head a run of `method` uses: `auto` is the method's own (its registry entry: the
    prototype library for fedbnn, as in the paper; the fixed output layer for the others)."""
    if head == "auto":
        m = NAMES.get("methods", {}).get(method)
        return m.head if m is not None else "fixed"
    return head


def _check_entry(method: str, fed: FedConfig, learn: LearnConfig) -> None:
    """Names against the registries (methods, encodings, each encoding's aggregation rules)
    and the pairings their descriptors declare."""
    methods, encodings = _registries()
    m = methods.get(method)
    if m is None:
        raise ConfigError(f"unknown method '{method}'; choose from {', '.join(methods)}")
    e = encodings.get(fed.encoding)
    if e is None:
        raise ConfigError(f"unknown encoding '{fed.encoding}'; choose from "
                          f"{', '.join(encodings)}")
    if fed.aggregation not in e.rules:
        others = [n for n, x in encodings.items() if fed.aggregation in x.rules]
        hint = f" (it needs --encoding {' or '.join(others)})" if others else ""
        raise ConfigError(f"unknown aggregation '{fed.aggregation}' for encoding '{e.name}'"
                          f"{hint}; choose from {', '.join(e.rules)}")
    if m.encoding and fed.encoding != m.encoding:
        raise ConfigError(f"method {method} needs --encoding {m.encoding}")
    if e.method and method != e.method:
        raise ConfigError(f"encoding {e.name} needs method {e.method} (--method {e.method} "
                          "sets both)")
    if fed.value_dtype not in e.value_dtypes:
        raise ConfigError(f"value_dtype {fed.value_dtype} does not work with the {e.name} "
                          f"encoding; choose from {', '.join(e.value_dtypes)}")
    if (fed.downlink == "sparse" or fed.global_topk > 0) and not e.sparse_downlink:
        ok = ", ".join(n for n, x in encodings.items() if x.sparse_downlink)
        what = "downlink sparse" if fed.downlink == "sparse" else "global_topk"
        raise ConfigError(f"{what} works with the {ok} encodings")
    heads = NAMES["heads"]
    if learn.head != "auto" and learn.head not in heads:
        raise ConfigError(f"unknown head '{learn.head}'; choose from auto, {', '.join(heads)}")
    if learn.task_free and heads[resolve_head(learn.head, method)].library:
        raise ConfigError("task_free does not work with head prototypes yet (its loss signal "
                          "needs a fixed class set)")
    if learn.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {learn.warmup_steps}")
    if learn.score_source != "tta" and not e.bayesian:
        bayes = " or ".join(n for n, x in encodings.items() if x.bayesian)
        raise ConfigError(f"score_source {learn.score_source} needs a Bayesian model: use "
                          f"--encoding {bayes} or method vfcl/fedbnn")


def require(checks: list[tuple[bool, str]], section: Any = None) -> None:
    """Raise ConfigError with the message of the first check that fails, a float of
    `section` (a config dataclass) that is not finite first; the error's field is the
    section's field that the message starts with."""
    name = "run" if isinstance(section, RunConfig) else next(
        (k for k, cls in SECTIONS.items() if isinstance(section, cls)), "")
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)} \
        if section is not None else {}
    finite = [(math.isfinite(v), f"{k} must be a finite number") for k, v in fields.items()
              if isinstance(v, float)]
    for ok, msg in finite + checks:
        if not ok:
            first = msg.split(" ", 1)[0]
            raise ConfigError(msg, f"{name}.{first}" if first in fields else "")


def check_data(d: DataConfig) -> None:
    """The [data] values that cannot work (the dataset spec's form, once the loaders
    registered theirs: its files are checked when it loads)."""
    forms = NAMES.get("datasets", {})
    kind, _, path = d.dataset.partition(":")
    form = forms.get(kind.strip().lower())
    require([
        (not forms or form is not None,
         f"dataset '{d.dataset}' is unknown; valid forms: {', '.join(forms.values())}"),
        (form is None or (":" in form) == bool(path.strip()),
         f"dataset '{d.dataset}': use {form}" if form else ""),
        (d.tasks >= 1, "tasks must be >= 1"),
        (d.mnist1d_samples >= 10, "mnist1d_samples must be >= 10 (one a class)"),
        (d.batch_size >= 1, "batch_size must be >= 1"),
        (0 < d.imbalance <= 1, "imbalance must be in (0, 1]"),
        (0 <= d.val_fraction < 1, "val_fraction must be in [0, 1)"),
        (0 < d.test_fraction < 1, "test_fraction must be in (0, 1)"),
        (d.split in ("overlap", "non-overlap"),
         f"split must be overlap or non-overlap, got {d.split!r}"),
    ], d)


def check_learn(le: LearnConfig) -> None:
    """The [learn] values that cannot work."""
    require([
        (le.memory_size >= 0, "memory_size must be >= 0"),
        (le.hidden >= 1, "hidden must be >= 1"),
        (le.lr > 0, "lr must be > 0"),
        (le.noise_std >= 0, "noise_std must be >= 0"),
        (le.fedprox_mu >= 0, "fedprox_mu must be >= 0"),
        (le.threads >= 1, "threads must be >= 1"),
        (le.current_share in (*CURRENT_SHARES, "auto"),
         "current_share must be equal, stream or auto"),
        (le.rescore in ("on_change", "always", "never"),
         "rescore must be on_change, always or never"),
        (le.local_epochs >= 1, "local_epochs must be >= 1"),
        (0 < le.bn_momentum <= 1, "bn_momentum must be in (0, 1]"),
        (le.score_chunk >= 0, "score_chunk must be >= 0 (0: auto)"),
        (le.batch_clients in ("auto", "on", "off"), "batch_clients must be auto, on or off"),
        (le.compile_step in ("auto", "on", "off"), "compile_step must be auto, on or off"),
        (le.optimizer in ("adam", "sgd"),
         f"optimizer must be adam or sgd, got {le.optimizer!r}"),
        (le.model in ("auto", "mlp", "cnn", "resnet18"),
         f"model must be auto|mlp|cnn|resnet18, got {le.model!r}"),
        (le.score_source in ("tta", "posterior", "both"),
         "score_source must be tta, posterior or both"),
        (le.score_samples >= 1, "score_samples must be >= 1"),
        (le.eval_samples >= 0, "eval_samples must be >= 0"),
        (le.bayes_sigma > 0, "bayes_sigma must be > 0"),
        (le.lambda_p >= 0, "lambda_p must be >= 0"),
        (0 <= le.lambda_k <= 1, "lambda_k must be in [0, 1]"),
        (le.vfcl_samples >= 1, "vfcl_samples must be >= 1"),
        (le.kl_scale in ("samples", "params"), "kl_scale must be samples or params"),
        (le.drift_signal in ("loss", "features"), "drift_signal must be loss or features"),
        (0 <= le.drift_delta < 1, "drift_delta must be in [0, 1)"),
        (le.score_backend in SCORE_BACKENDS, "score_backend must be auto, torch or "
         "onnxruntime"),
        (le.score_backend != "onnxruntime" or le.score_source == "tta",
         "score_backend onnxruntime computes TTA logits only; use score_source tta"),
        (le.score_backend != "onnxruntime" or le.device == "cpu",
         "score_backend onnxruntime runs on the CPU; use it with device cpu"),
        (le.apc_l1 >= 0 and le.apc_l2 >= 0 and le.apc_prune >= 0,
         "apc_l1, apc_l2 and apc_prune must be >= 0"),
        (0 < le.apc_send <= 1, "apc_send must be in (0, 1]"),
    ], le)


def check_fed(f: FedConfig) -> None:
    """The [fed] values that cannot work."""
    require([
        (f.bnn_init_rounds >= 0, "bnn_init_rounds must be >= 0"),
        (f.clients >= 1, "clients must be >= 1"),
        (f.burn_in >= 0, "burn_in must be >= 0"),
        (f.jump >= 1, "jump must be >= 1"),
        (0 <= f.mix <= 1, "mix must be in [0, 1]"),
        (f.min_clients >= 1, "min_clients must be >= 1"),
        (f.round_timeout >= 0, "round_timeout must be >= 0 seconds"),
        (f.max_staleness >= 0, "max_staleness must be >= 0"),
        (0 <= f.quorum <= 1, "quorum must be in [0, 1] (a share of the active clients)"),
        (f.round_max_mib >= 0, "round_max_mib must be >= 0 (0: no bound)"),
        (f.mode in ("sync", "async"), f"mode must be sync or async, got {f.mode!r}"),
        (0 <= f.topk <= 1, "topk must be in [0, 1] (fraction of entries sent)"),
        (f.threshold >= 0, "threshold must be >= 0"),
        (f.topk > 0 or f.threshold > 0, "topk 0 needs a threshold > 0"),
        (f.value_dtype in ("auto", "float32", "float16", "bfloat16"),
         "value_dtype must be auto, float32, float16 or bfloat16"),
        (f.index_format in ("auto", "idx", "bits", "zidx", "zbits"),
         "index_format must be auto, idx, bits, zidx or zbits"),
        (f.downlink in ("auto", "dense", "sparse", "pull"),
         "downlink must be auto, dense, sparse or pull"),
        (0 <= f.global_topk < 1, "global_topk must be in [0, 1) (0: off)"),
        (f.global_topk == 0 or f.downlink in ("auto", "sparse"),
         "global_topk needs --downlink sparse (or auto): with whole globals it saves nothing"),
        (f.apc_kb_size >= 0, "apc_kb_size must be >= 0"),
        (f.roster_cap >= 0 and f.sample_cap >= 0, "roster_cap and sample_cap must be >= 0"),
        (f.client_timeout >= 0, "client_timeout must be >= 0"),
        (f.clip_factor >= 0 and f.clip_norm >= 0, "clip_factor and clip_norm must be >= 0"),
        (0 <= f.max_share <= 1, "max_share must be in [0, 1]"),
        (f.sender_rate >= 0, "sender_rate must be >= 0 (0: no limit)"),
        (0 <= f.sender_cpu <= 1, "sender_cpu must be in [0, 1] (0: no limit)"),
        (0 <= f.trim < 0.5, "trim must be in [0, 0.5)"),
        (f.sigma_floor >= 0, "sigma_floor must be >= 0"),
        (f.max_seq_gap >= 1, "max_seq_gap must be >= 1"),
        (f.max_backpressure >= 1, "max_backpressure must be >= 1 (1: off)"),
        (f.buffer >= -1, "buffer must be >= -1 (0: half the active devices from 100 on; "
                         "-1: off)"),
        (f.staleness in STALENESS, f"staleness must be one of {', '.join(STALENESS)}"),
        (f.staleness_a >= 0, "staleness_a must be >= 0"),
        (f.staleness_b >= 0, "staleness_b must be >= 0"),
        (0 < f.task_decay <= 1, "task_decay must be in (0, 1] (1: off)"),
        (f.task_gate >= 0, "task_gate must be >= 0 seconds (0: off)"),
        (f.gate_carry_mib >= 0, "gate_carry_mib must be >= 0 (0: off)"),
        (f.in_flight >= 0, "in_flight must be >= 0 (0: off)"),
    ], f)


def check_mqtt(m: MqttConfig) -> None:
    """The [mqtt] values that cannot work."""
    require([
        (m.wire_dtype in ("float32", "float16"), "wire_dtype must be float32 or float16"),
        (m.broker == "" or _broker_url(m.broker),
         "broker must look like mqtt://HOST:PORT or mqtts://HOST:PORT (a port up to 65535)"),
        (m.chunk_size >= 1024, "chunk_size must be >= 1024 bytes"),
        (m.max_payload >= 0, "max_payload must be >= 0 bytes (0: sized from the model)"),
        (m.connect_timeout > 0, "connect_timeout must be > 0 seconds"),
    ], m)


def _broker_url(url: str) -> bool:
    """Whether `url` is mqtt:// or mqtts:// with a host and, if any, a valid port."""
    try:
        parts = urlsplit(url)
        return parts.scheme in ("mqtt", "mqtts") and bool(parts.hostname) and (
            parts.port is None or parts.port > 0)
    except ValueError:  # a port that is no number, or out of range
        return False


def split_credentials(url: str) -> tuple[str, str, str]:
    """`mqtt://user:pw@host:port` -> ("mqtt://host:port", "user", "pw"); a URL without
    credentials comes back as it is, with two empty strings."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, "", ""
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, unquote(parts.username or ""), unquote(parts.password or "")


def settle_mqtt(m: MqttConfig) -> None:
    """Move credentials written into the broker URL to `username` / `password` (fields given
    on their own win): the URL is logged, shown and saved, a secret must never be."""
    bare, user, password = split_credentials(m.broker)
    if bare != m.broker:
        m.broker, m.username, m.password = bare, m.username or user, m.password or password


def public_dict(cfg: RunConfig) -> dict[str, Any]:
    """`to_dict(cfg)` without the MQTT password: what results, state and logs may hold."""
    d = to_dict(cfg)
    d["mqtt"]["password"] = ""
    return d


PROFILE_KINDS = ("homogeneous", "heterogeneous", "congested")
"""The timing profiles of in-process async runs by name (`sim/profiles.py`), besides
trace:PATH."""


def validate(cfg: RunConfig) -> None:
    """Reject values that cannot work, with a message that says what to fix: every section's
    checks, the run's, and the names against the registries. A config runs it on
    construction; `apply` runs it again after setting fields (credentials in the broker URL
    move to their own fields first)."""
    settle_mqtt(cfg.mqtt)
    check_data(cfg.data)
    check_learn(cfg.learn)
    check_fed(cfg.fed)
    check_mqtt(cfg.mqtt)
    require([
        (cfg.seed >= 0, "seed must be >= 0"),
        (cfg.seeds >= 1, "seeds must be >= 1"),
        (cfg.transport in ("inprocess", "mqtt"), "transport must be inprocess or mqtt"),
        (cfg.profile in PROFILE_KINDS or cfg.profile.startswith("trace:")
         and len(cfg.profile) > len("trace:"),
         f"unknown timing profile '{cfg.profile}'; choose from homogeneous, heterogeneous, "
         "congested or trace:PATH"),
        (cfg.profile == "homogeneous" or cfg.fed.mode == "async",
         f"profile {cfg.profile} needs mode async (lock-step runs have no timing to draw)"),
        (cfg.profile == "homogeneous" or cfg.transport == "inprocess",
         f"profile {cfg.profile} draws timing on the in-process virtual clock; a run over "
         "--transport mqtt has the real one"),
    ], cfg)
    for _, method, fed in run_entries(cfg):
        _check_entry(method, fed, cfg.learn)


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
