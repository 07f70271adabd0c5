"""The Strategy contract and the dense rules: validate nothing (the encoding does), fold updates
into running sums (memory independent of the client count), produce the next global.

A strategy is ONE long-lived object per run (the Aggregator builds it from the encoding
registry, `edgefcl.federation.registry`), so server state across rounds may live in it. Per
round: `configure_round(RoundInput)` opens the round (fresh accumulators), `add(update)` for
every update, `result(previous)` returns the new global, mixed with the previous one by
`mix` (the only place mixing happens), and `counters()` what the round counted.

Sum-decomposable strategies (`decomposable = True`) can also hand their round's weighted sums
to another process (`partial()`, msgpack-able) and fold one in (`merge(partial)`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.value_bound import MAX_VALUE

Spec = dict[str, tuple[int, ...]]
"""Global tensor name -> shape."""


class WeightedSum:
    """Running sum of weight * tensors, accumulated in float64."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] | None = None
        self.weight = 0.0

    def add(self, tensors: Tensors, weight: float) -> None:
        if self.sums is None:
            self.sums = {k: np.zeros(v.shape, np.float64) for k, v in tensors.items()}
        for k, v in tensors.items():
            self.sums[k] += weight * v.astype(np.float64, copy=False)
        self.weight += weight

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean, float64."""
        if self.sums is None or self.weight <= 0:
            raise ValueError("no contributions to average")
        return {k: v / self.weight for k, v in self.sums.items()}


def mix(new: dict[str, np.ndarray], previous: Tensors, weight: float,
        sent: dict[str, np.ndarray] | None = None) -> Tensors:
    """weight * new + (1 - weight) * previous, as float32 (the paper's 0.5/0.5 smoothing).

    Tensors absent from `new` keep their previous value; with `sent` (flat boolean masks per
    tensor), so do the entries nobody sent."""
    out: Tensors = {}
    for k, prev in previous.items():
        if k not in new:
            out[k] = prev
            continue
        mixed = weight * new[k].reshape(prev.shape) + (1.0 - weight) * prev.astype(np.float64)
        if sent is not None and k in sent:
            mixed = np.where(sent[k].reshape(prev.shape), mixed, prev)
        out[k] = mixed.astype(np.float32)
    return out


def sample_weight(update: Update) -> float:
    """An update's sample weight: `num_samples` (admission keeps it >= 1; the share cap and
    the async round weights scale it, `round_weights.py`), 1 where it is not positive."""
    n = float(update.num_samples)
    return n if n > 0 else 1.0


def check_tensor(t: np.ndarray, shape: tuple[int, ...]) -> str | None:
    """Reason to reject one dense tensor: shape, dtype (float32), finiteness, magnitude
    (at most MAX_VALUE)."""
    if tuple(t.shape) != tuple(shape):
        return "shape"
    if t.dtype != np.float32:
        return "dtype"
    return value_reason(t)


def value_reason(t: np.ndarray) -> str | None:
    """"nonfinite" if `t` holds a NaN or an infinity, "range" if a value beyond MAX_VALUE in
    magnitude, else None: one pass (the largest magnitude is NaN or infinite exactly when a
    value is)."""
    if not t.size:
        return None
    largest = float(np.abs(t).max())
    if largest <= MAX_VALUE:
        return None
    return "range" if math.isfinite(largest) else "nonfinite"


def check_dense(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject a dense payload: names, then `check_tensor` for each tensor."""
    if set(tensors) != set(spec):
        return "names"
    for k, t in tensors.items():
        reason = check_tensor(t, spec[k])
        if reason is not None:
            return reason
    return None


@dataclass(frozen=True)
class RoundInput:
    """What a strategy is told when a round opens."""

    version: int
    """Version of the current global (the one the round's result replaces)."""
    previous: Tensors
    """The current global."""
    bases: Callable[[int], Tensors | None] = lambda version: None
    """The global of a past version, if still held (bases of delta encodings)."""
    participants: tuple[str, ...] = ()
    """Clients whose updates the round aggregates, in the order they are added."""
    options: dict[str, Any] = field(default_factory=dict)
    """What else a rule needs from the scheduler (free-form, empty today)."""


class Strategy:
    """Base of every aggregation rule: one long-lived object per run.

    Subclasses set up per-round accumulators in `reset()`, fold one update in `add()` and
    return the unmixed estimate from `estimate()`; `result()` mixes it with the previous
    global (`mix`, overridden only where the mixture is not linear: Gaussians).
    """

    decomposable: ClassVar[bool] = False
    """True for rules whose round state is sums (`partial()` / `merge()` work)."""
    weights_by_class: ClassVar[bool] = False
    """True for rules whose weights are per class, not per sample (the share cap then caps
    each update's share of the class-weighted average: `robust/share.py`)."""
    adds_variances: ClassVar[bool] = False
    """True for Gaussian rules whose global variance sums the clients' (moment matching): a
    client's sigma is then bounded above too (`robust/sigma_floor.py`)."""
    multiplies_likelihoods: ClassVar[bool] = False
    """True for rules that multiply the previous global by the clients' likelihoods (FedBNN):
    clients then send likelihoods after the standard-network phase, and Gaussian prototype
    rows follow the same product."""

    def row_combiner(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """How the rows one label's senders sent combine into the label's prototype row
        (stack (senders, width) -> (width,)), for point prototype libraries: None for the
        share-capped sample-weighted mean; the robust rules give their own estimator."""
        return None

    def __init__(self, fed: FedConfig, spec: Spec) -> None:
        self.fed = fed
        self.spec = dict(spec)
        self.mix_base = fed.mix
        self.counts: Counter[str] = Counter()
        self.round = RoundInput(-1, {})
        self.fresh = [0.0, 0.0]
        self.reset()

    # -- the contract ----------------------------------------------------------------------
    def configure_round(self, rnd: RoundInput) -> None:
        """Open a round: fresh accumulators and counters."""
        self.round = rnd
        self.counts = Counter()
        self.fresh = [0.0, 0.0]
        self.reset()

    def add(self, update: Update) -> None:
        """Fold one (validated, decoded) update into the round."""
        raise NotImplementedError

    def result(self, previous: Tensors) -> Tensors:
        """The new global: the round's estimate mixed with `previous`."""
        new, sent = self.estimate(previous)
        return self.mix(new, previous, sent)

    def note_freshness(self, samples: float, weight: float) -> None:
        """Note an update's samples and staleness weight for the round's mix (`mix_weight`;
        `round_weights.weigh` calls it)."""
        self.fresh[0] += samples * weight
        self.fresh[1] += samples

    @property
    def mix_weight(self) -> float:
        """`mix` times the round's sample-weighted mean staleness weight (FedAsync's
        alpha * s(tau)); `mix` itself under the constant rule."""
        if not self.fresh[1]:
            return self.mix_base
        return self.mix_base * self.fresh[0] / self.fresh[1]

    def fresh_partial(self) -> dict:
        """The staleness weights noted so far, for a partial (`merge_fresh` adds them)."""
        return {"fresh": {"weight": self.fresh[0], "count": self.fresh[1]}}

    def merge_fresh(self, partial: dict) -> None:
        """Add a partial's staleness weights (none in a partial of the constant rule)."""
        fresh = partial.get("fresh") or {}
        self.fresh[0] += float(fresh.get("weight", 0.0))
        self.fresh[1] += float(fresh.get("count", 0.0))

    def counters(self) -> Counter[str]:
        """What this round counted (added to the aggregator's counters when it closes)."""
        return self.counts

    def kept(self) -> dict:
        """What the rule keeps from one round to the next (JSON-able; a new dict each call):
        saved with the aggregator's state, and what a dropped round goes back to. None by
        default."""
        return {}

    def load_kept(self, kept: dict) -> None:
        """Take back what `kept()` returned (from a saved state: untrusted shapes are left
        out)."""

    def partial(self) -> dict:
        """The round's weighted sums and weights (msgpack-able), for a coordinator to merge."""
        raise NotImplementedError(f"{type(self).__name__} is not sum-decomposable")

    def merge(self, partial: dict) -> None:
        """Fold another worker's `partial()` into this round."""
        raise NotImplementedError(f"{type(self).__name__} is not sum-decomposable")

    def partial_weights(self, partial: dict) -> dict[str, np.ndarray] | None:
        """A `partial()`'s weights in the round, as the share cap weighs an update's: named
        flat arrays, one weight an entry (or one for the whole partial); None: the rule has
        none, and a sharded root caps no partial of it."""
        return None

    def scale_partial(self, partial: dict, factors: dict[str, np.ndarray]) -> dict:
        """`partial` with each of its `partial_weights` times the factors of the same name
        (what it says of the values unchanged)."""
        raise NotImplementedError(f"{type(self).__name__} has no partial weights")

    # -- for subclasses --------------------------------------------------------------------
    def reset(self) -> None:
        """Create the per-round accumulators."""

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray],
                                                   dict[str, np.ndarray] | None]:
        """(new values per tensor, float64; flat masks of the entries someone sent, or None
        when every entry of every new tensor was)."""
        raise NotImplementedError

    def mix(self, new: dict[str, np.ndarray], previous: Tensors,
            sent: dict[str, np.ndarray] | None) -> Tensors:
        """Mix the estimate with the previous global (linear, `mix_weight`)."""
        return mix(new, previous, self.mix_weight, sent)


class FedAvg(Strategy):
    """FedAvg weighted by the samples each client saw in its current task."""

    decomposable = True

    def reset(self) -> None:
        self.acc = WeightedSum()

    def add(self, update: Update) -> None:
        self.acc.add(update.tensors, sample_weight(update))

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray], None]:
        return self.acc.mean(), None

    def partial(self) -> dict:
        """{"weight": w, "sums": {name: float64 sum of w * tensor}}."""
        return {"weight": self.acc.weight, "sums": dict(self.acc.sums or {}),
                **self.fresh_partial()}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`."""
        merge_weighted_sum(self.acc, partial)
        self.merge_fresh(partial)

    def partial_weights(self, partial: dict) -> dict[str, np.ndarray]:
        """Its updates' sample weight."""
        return {"weight": np.array([float(partial.get("weight", 0.0))])}

    def scale_partial(self, partial: dict, factors: dict[str, np.ndarray]) -> dict:
        return {**partial, **scaled_sum(partial, scalar_factor(factors, "weight"))}


MAX_ROUND_CLASSES = 256
"""Class ids a class-weighted round keeps a model for; the samples of any further class go to
class -1 (`classes_folded` counts each update's class so folded). Class ids are devices'
claims: each update's are bounded (robust/class_claims.py), but not how many distinct ones a
round's updates bring, which sets its memory and a shard worker's partial (the root decodes
partials sized for this many)."""


class ClassWeightedFedAvg(Strategy):
    """'Weighted FedAvg': average the models per class present in the round (weighted by the
    client's samples of that class), then average the class models equally (at most
    MAX_ROUND_CLASSES classes)."""

    decomposable = True
    weights_by_class = True

    def reset(self) -> None:
        self.per_class: dict[int, WeightedSum] = {}

    def _class(self, c: int) -> WeightedSum:
        """The accumulator of class `c`, or of class -1 once the round holds its maximum."""
        if c not in self.per_class and len(self.per_class) >= MAX_ROUND_CLASSES:
            self.counts["classes_folded"] += 1
            c = -1
        return self.per_class.setdefault(c, WeightedSum())

    def add(self, update: Update) -> None:
        counts = update.class_counts or {-1: update.num_samples}
        for c, n in sorted(counts.items()):
            if n > 0:
                self._class(int(c)).add(update.tensors, float(n))

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray], None]:
        if not self.per_class:
            raise ValueError("no contributions to average")
        means = [self.per_class[c].mean() for c in sorted(self.per_class)]
        return {k: sum(m[k] for m in means) / len(means) for k in means[0]}, None

    def partial(self) -> dict:
        """{"classes": {class: {"weight": w, "sums": {...}}}} (class ids as strings)."""
        return {"classes": {str(c): {"weight": a.weight, "sums": dict(a.sums or {})}
                            for c, a in sorted(self.per_class.items())},
                **self.fresh_partial()}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`, class by class."""
        for c, p in sorted(partial["classes"].items(), key=lambda kv: int(kv[0])):
            merge_weighted_sum(self._class(int(c)), p)
        self.merge_fresh(partial)


def scaled_sum(partial: dict, factor: float) -> dict:
    """A partial {"weight", "sums"} of a weighted sum with its weight times `factor`."""
    return {"weight": float(partial.get("weight", 0.0)) * factor,
            "sums": {k: np.asarray(v, np.float64) * factor
                     for k, v in partial["sums"].items()}}


def scalar_factor(factors: dict[str, np.ndarray], name: str) -> float:
    """The one factor named `name` (1 where none)."""
    f = factors.get(name)
    return 1.0 if f is None else float(np.asarray(f).ravel()[0])


def entry_weights(prefix: str, arrays: dict) -> dict[str, np.ndarray]:
    """Per-entry weight arrays, flat, named `prefix/<tensor>`."""
    return {f"{prefix}/{k}": np.asarray(v, np.float64).ravel() for k, v in arrays.items()}


def entry_scaled(prefix: str, arrays: dict, factors: dict[str, np.ndarray]) -> dict:
    """`arrays` (tensor -> array) times the flat factors named `prefix/<tensor>` (1 where
    none), float64."""
    out = {}
    for k, v in arrays.items():
        v = np.asarray(v, np.float64)
        f = factors.get(f"{prefix}/{k}")
        out[k] = v if f is None else v * np.asarray(f).reshape(v.shape)
    return out


def merge_weighted_sum(acc: WeightedSum, partial: dict) -> None:
    """Add a partial {"weight", "sums"} into `acc` (no-op for an empty one)."""
    if not partial["sums"]:
        return
    if acc.sums is None:
        acc.sums = {k: np.zeros(np.shape(v), np.float64) for k, v in partial["sums"].items()}
    for k, v in partial["sums"].items():
        acc.sums[k] += np.asarray(v, np.float64)
    acc.weight += float(partial["weight"])
