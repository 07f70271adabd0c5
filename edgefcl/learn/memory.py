"""Fixed-size replay memory: the storage every population policy shares, and the helpers of
the class-balanced ones.

`ReplayMemory` preallocates the storage on one torch device (samples, labels, tasks, cached
scores), draws the replay samples, counts the classes and saves and restores the state; one
subclass per policy implements its population rule (`_offer`), named by its entry in
`memory_policies.POLICIES`:

- "reservoir" (ER): `memory_reservoir.ReservoirMemory`, reservoir sampling over the stream;
- "balanced-random" (CBR): `memory_balanced.BalancedRandomMemory`, class-balanced, a uniform
  draw within an over-quota class;
- "balanced-score" (BI and the other scores): `memory_scored.BalancedScoreMemory`,
  class-balanced, over-quota classes ranked by an uncertainty score.

Every update is vectorized over the candidates (no per-sample Python loops). All randomness
comes from one `torch.Generator` seeded at construction, so a run is reproducible for a seed
and survives a `state_dict()` / `load_state_dict()` round-trip (device reboots).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from edgefcl.config import CURRENT_SHARES, ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.selection import Candidates, Selection, get_selection

RESCORES = ("on_change", "always", "never")
"""Which cached scores a score-ranked memory scores again (`memory_scored`)."""
_STATE_KEYS = (
    "capacity",
    "sample_shape",
    "policy",
    "selection",
    "size",
    "seen",
    "x",
    "y",
    "task",
    "score",
    "score_version",
    "classes",
    "priority",
    "generator",
)
_OPTIONAL_STATE = {"rank_past": False, "current_share": "equal", "current_task": None,
                   "current_seen": 0}

UNIFORM = get_selection("random")
"""How every class that no rule ranks is cut: a uniform draw."""
Scorer = Callable[[Tensor], Tensor]
"""Maps a stacked batch of samples (m, *sample_shape) to m uncertainty scores."""
Featurizer = Callable[[Tensor], Tensor]
"""Maps a stacked batch of samples (m, *sample_shape) to (m, d) features."""


@dataclass(frozen=True)
class Scoring:
    """What an update gives a memory that ranks by scores (the other policies ignore it).

    scorer: called at most once an update, on the stacked candidates that need a score;
    version: the scoring model's version, cached with the scores; featurizer (rules that need
    features): called at most once, on the candidates of ranked classes; scores: the scores
    of the candidates `pending_scores` returned for this update, computed ahead (the scorer
    is then not called)."""

    scorer: Scorer
    version: int = 0
    featurizer: Featurizer | None = None
    scores: Tensor | None = None


@dataclass(frozen=True)
class Replacement:
    """A full class-balanced memory's update up to the choice of the candidates it keeps:
    `uniform`, the candidates of the classes a uniform draw cuts; `ranked`, the memory's rule,
    its candidates and the mask of those it decides (None: no class is ranked); `write`, what
    keeps the choice (the kept mask, on the host), and the scores cached with it; `scored`,
    the candidates scored for it.
    `choose` makes the choice alone; `memory_fleet.choose_together` makes several memories'
    at once."""

    uniform: Candidates
    ranked: tuple[Selection, Candidates, Tensor] | None
    write: Callable[[np.ndarray], None]
    scored: int = 0
    unchecked: Tensor | None = None
    """The new scores, checked for NaN and Inf before the choice is kept (where they are:
    `choose_together` checks every memory's in the read of the masks)."""

    def kept(self) -> Tensor:
        """The kept-candidate mask, on the memory's device."""
        keep = UNIFORM.select(self.uniform)
        if self.ranked is not None:
            rule, cands, decided = self.ranked
            keep = torch.where(decided, rule.select(cands), keep)
        return keep

    def choose(self) -> None:
        """Choose and keep the candidates (one host read: the mask)."""
        if self.unchecked is not None:
            check_finite(self.unchecked)
        self.write(on_host(self.kept()))


NONFINITE = "scorer returned NaN or Inf scores; check the scoring model"
"""The error of a memory offered non-finite scores."""


def check_finite(scores: Tensor) -> None:
    """DataError when `scores` hold NaN or Inf (a read of the device where they are)."""
    if not bool(torch.isfinite(scores).all()):
        raise DataError(NONFINITE)


def water_fill(counts: np.ndarray, priority: np.ndarray, capacity: int) -> np.ndarray:
    """Per-class number of kept samples for candidate `counts` (all > 0) and `capacity`.

    q = the largest integer with sum_c min(counts_c, q) <= capacity; each class keeps
    min(counts_c, q), and the capacity - sum leftover slots go one each to the over-quota
    classes with the lowest `priority`. Requires counts.sum() > capacity >= 0.
    """
    m = counts.size
    ns = np.sort(counts)
    before = np.cumsum(ns) - ns  # candidates of the classes smaller than class i
    # f(ns[i]) = sum_c min(counts_c, ns[i]); the first i where it exceeds capacity is the
    # first over-quota class, and there f(q) = before[i] + q * (m - i).
    fill = before + ns * (m - np.arange(m))
    i = int(np.argmax(fill > capacity))
    q = (capacity - before[i]) // (m - i)
    keep = np.minimum(counts, q)
    leftover = capacity - keep.sum()
    over = counts > q
    rank = np.empty(m, dtype=np.int64)
    rank[np.argsort(np.where(over, priority, np.inf), kind="stable")] = np.arange(m)
    return keep + (over & (rank < leftover))


def stream_paced(counts: np.ndarray, priority: np.ndarray, current: np.ndarray, share: int,
                 grouping: Grouping, capacity: int) -> np.ndarray:
    """Per-group kept samples under `stream` pacing: the current task's groups (`current`)
    together keep at most `share` (all their candidates when they have fewer); the past groups
    share the rest (`grouping.allot`), and what they cannot fill goes back to the current
    groups, so the memory stays full. Requires counts.sum() > capacity."""
    cur, past = counts[current], counts[~current]
    keep = np.empty_like(counts)
    room_past = capacity - min(int(cur.sum()), share)
    keep[~current] = (past if int(past.sum()) <= room_past
                      else grouping.allot(past, priority[~current], room_past))
    room_cur = capacity - int(keep[~current].sum())
    keep[current] = (cur if int(cur.sum()) <= room_cur
                     else grouping.allot(cur, priority[current], room_cur))
    return keep


class Grouping(ABC):
    """How a balanced memory groups its candidates and shares its capacity among the groups.

    `key` maps every candidate to an integer group (>= 0); `allot` gives every group's number
    of kept samples. Groups get a random leftover priority when first seen (the memory draws
    it), passed to `allot`. Both work on numpy arrays: the memory plans on the host, where
    these small integer arrays cost a few microseconds an operation (torch's own per-operation
    cost made the plan 3-4x slower)."""

    name: str = ""

    @abstractmethod
    def key(self, y: np.ndarray, task: np.ndarray) -> np.ndarray:
        """(n,) int64 group of every candidate, from its label `y` and task `task`."""

    @abstractmethod
    def allot(self, counts: np.ndarray, priority: np.ndarray, capacity: int) -> np.ndarray:
        """(m,) kept samples per group for candidate `counts` (sum > capacity)."""


class ClassBalanced(Grouping):
    """One group per class label; water-filling allotment (`water_fill`)."""

    name = "class"

    def key(self, y: np.ndarray, task: np.ndarray) -> np.ndarray:
        return y

    def allot(self, counts: np.ndarray, priority: np.ndarray, capacity: int) -> np.ndarray:
        return water_fill(counts, priority, capacity)


def on_host(t: Tensor) -> np.ndarray:
    """t as a numpy array (a view for a CPU tensor)."""
    return t.detach().cpu().numpy()


class ReplayMemory(ABC):
    """A replay memory of `capacity` samples of shape `sample_shape` on `device`; a subclass
    per policy fills it (`_offer`).

    Settings of the class-balanced policies: grouping (`ClassBalanced` by default: classes,
    water-filling), current_share (one of `CURRENT_SHARES`); of the score-ranked one:
    selection (a rule of `edgefcl.learn.selection`, or its name), rank_past, rescore (one of
    `RESCORES`). The state of every policy records selection, rank_past and current_share: a
    checkpoint loads only into a memory with the same ones.
    Filled slots are [0, size): x, y, task, score and score_version (-1: no score) hold them;
    `_classes` (sorted) and `_priority` are every group a balanced memory was offered and its
    leftover priority, `current_task` / `current_seen` its last batch's task and that task's
    samples offered so far. The bookkeeping (which class and task each slot holds, its score
    version, the groups) also lives on the host, where the allotment and the replay draw read
    it: an update or a draw reads nothing back from the device but the kept-candidate mask of
    a full memory (and a scorer's scores, to check them).
    """

    name: ClassVar[str] = ""
    """The policy's name, its key in `memory_policies.POLICIES` (kept in the state)."""
    scored: ClassVar[bool] = False
    """Whether an update scores candidates: it then needs a `Scoring`."""

    def __init__(
        self,
        capacity: int,
        sample_shape: tuple[int, ...],
        selection: Selection | str = "bottom",
        device: str | torch.device = "cpu",
        seed: int = 0,
        x_dtype: torch.dtype = torch.float32,
        rank_past: bool = False,
        grouping: Grouping | None = None,
        current_share: str = "equal",
        rescore: str = "on_change",
    ) -> None:
        if capacity < 0:
            raise ConfigError(f"memory capacity must be >= 0, got {capacity}")
        if current_share not in CURRENT_SHARES:
            raise ConfigError(f"unknown current_share '{current_share}'; choose from "
                              f"{CURRENT_SHARES}")
        if rescore not in RESCORES:
            raise ConfigError(f"unknown rescore '{rescore}'; choose from {RESCORES}")
        self.rule = get_selection(selection) if isinstance(selection, str) else selection
        self.selection = self.rule.name
        self.current_share = current_share
        self.grouping = grouping if grouping is not None else ClassBalanced()
        self.rank_past = bool(rank_past)
        self.rescore = rescore
        self.capacity = int(capacity)
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.device = torch.device(device)
        self.size = 0
        self.seen = 0
        self.current_task: int | None = None
        self.current_seen = 0
        self.x = torch.zeros((self.capacity, *self.sample_shape), dtype=x_dtype, device=self.device)
        self.y = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.task = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.score = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)
        self.score_version = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self._y_host = np.zeros(self.capacity, np.int64)  # host copies of y, task and
        self._task_host = np.zeros(self.capacity, np.int64)  # score_version
        self._version_host = np.full(self.capacity, -1, np.int64)
        self._classes = np.zeros(0, np.int64)
        self._priority = np.zeros(0, np.float32)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(seed))
        self.defer = False  # the current update's `defer` (`BalancedMemory._offer`)
        self.deferred: Replacement | None = None
        """The choice an update left to its caller (`update`'s `defer`)."""

    # ------------------------------------------------------------------ queries

    def sample(self, n: int, exclude_task: int | None = None) -> tuple[Tensor, Tensor] | None:
        """Uniform draw of min(n, eligible) filled slots without replacement, skipping slots
        of `exclude_task`; returns (x, y), or None when no slot is eligible or n <= 0."""
        self._settled()
        if n <= 0 or self.size == 0:
            return None
        if exclude_task is None:
            idx = torch.arange(self.size, device=self.device)
        else:
            idx = torch.from_numpy(
                np.flatnonzero(self._task_host[: self.size] != exclude_task)).to(self.device)
        if idx.numel() == 0:
            return None
        pick = torch.randperm(idx.numel(), generator=self._gen, device=self.device)[:n]
        slots = idx[pick]
        return self.x[slots], self.y[slots]

    def take_deferred(self) -> Replacement | None:
        """The choice the last update left to its caller (`update`'s `defer`; None: none),
        which the caller now owes: the memory is usable again once it is made."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def _settled(self) -> None:
        """RuntimeError while a deferred update's choice is not made (`update`)."""
        if self.deferred is not None:
            raise RuntimeError("the memory's last update was deferred and its choice not made")

    def class_counts(self) -> dict[int, int]:
        """Number of stored samples per class label (classes with none are left out)."""
        labels, counts = np.unique(self._y_host[: self.size], return_counts=True)
        return dict(zip(labels.tolist(), counts.tolist(), strict=True))

    def pending_scores(self, x: Tensor, y: Tensor, task: int, version: int,
                       labels: np.ndarray | None = None) -> Tensor | None:
        """The stacked candidates that `update` with this batch and scoring `version` will
        score, when known ahead (a caller can score them while it trains and pass the scores
        in `Scoring.scores`); None: none known ahead (a policy that scores nothing).
        `labels`: y on the host, as for `update`."""
        return None

    # ------------------------------------------------------------------ update

    def update(self, x: Tensor, y: Tensor, task: int, scoring: Scoring | None = None,
               labels: np.ndarray | None = None, defer: bool = False) -> int:
        """Offer a mini-batch (x, y) of `task`, x stored as x_dtype; returns the number of
        samples scored. `scoring` is what a policy that ranks by scores needs. `labels`: y on
        the host, when the caller has them (the labels it made y from): then y is not read
        back from the device. With `defer`, a full class-balanced memory leaves the choice of
        what it keeps in `deferred` (a `Replacement`) for its caller to make
        (`memory_fleet.choose_together`) before the memory is used again."""
        self._settled()
        self.defer = defer
        x, y, labels = self._check_batch(x, y, labels)
        if y.numel() == 0:
            return 0
        scored = self._offer(x, y, labels, task, scoring)
        self.seen += y.numel()
        return scored

    @abstractmethod
    def _offer(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
               scoring: Scoring | None) -> int:
        """The policy's population rule for a checked, non-empty batch (`labels`: y on the
        host; `seen` does not count it yet); returns the number of samples scored."""

    def _store(self, slots: slice | np.ndarray, x: Tensor, y: Tensor, labels: np.ndarray,
               task: int) -> slice | Tensor:
        """Write samples x with labels y (`labels` on the host) of `task` into `slots`;
        returns the slots as they index the device's tensors."""
        at = slots if isinstance(slots, slice) else torch.from_numpy(slots).to(self.device)
        self.x[at], self.y[at], self.task[at] = x, y, task
        self._y_host[slots], self._task_host[slots] = labels, task
        return at

    def _check_batch(self, x: Tensor, y: Tensor, labels: np.ndarray | None = None
                     ) -> tuple[Tensor, Tensor, np.ndarray]:
        if not isinstance(x, Tensor) or not isinstance(y, Tensor):
            raise DataError("memory update needs torch tensors x and y")
        if tuple(x.shape[1:]) != self.sample_shape:
            raise DataError(
                f"memory stores samples of shape {self.sample_shape}, got a batch of shape "
                f"{tuple(x.shape)}"
            )
        if y.dim() != 1 or y.numel() != x.shape[0]:
            raise DataError(f"labels must have shape ({x.shape[0]},), got {tuple(y.shape)}")
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise DataError(f"labels must be integers, got dtype {y.dtype}")
        y = y.to(self.device, torch.int64)
        labels = on_host(y) if labels is None else np.asarray(labels, np.int64)
        if labels.shape != (y.numel(),):
            raise DataError(f"host labels of shape {labels.shape} for {y.numel()} samples")
        if labels.size and labels.min() < 0:
            raise DataError("labels must be >= 0")
        return x.detach().to(self.device, self.x.dtype), y, labels

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (CPU tensors): filled slots, counters, classes, RNG."""

        def cpu(t: Tensor) -> Tensor:
            return t.detach().to("cpu", copy=True)

        s = self.size
        return {
            "capacity": self.capacity,
            "sample_shape": self.sample_shape,
            "policy": self.name,
            "selection": self.selection,
            "rank_past": self.rank_past,
            "current_share": self.current_share,
            "current_task": self.current_task,
            "current_seen": self.current_seen,
            "size": s,
            "seen": self.seen,
            "x": cpu(self.x[:s]),
            "y": cpu(self.y[:s]),
            "task": cpu(self.task[:s]),
            "score": cpu(self.score[:s]),
            "score_version": cpu(self.score_version[:s]),
            "classes": torch.from_numpy(self._classes.copy()),
            "priority": torch.from_numpy(self._priority.copy()),
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the capacity, sample shape, policy, selection, rank_past
        and current_share must match."""
        missing = [k for k in _STATE_KEYS if k not in d]
        if missing:
            raise ConfigError(f"not a ReplayMemory state: missing {missing}")
        mine = (self.capacity, self.sample_shape, self.name, self.selection,
                self.rank_past, self.current_share)
        theirs = (int(d["capacity"]), tuple(d["sample_shape"]), d["policy"], d["selection"],
                  bool(d.get("rank_past", _OPTIONAL_STATE["rank_past"])),
                  d.get("current_share", _OPTIONAL_STATE["current_share"]))
        if mine != theirs:
            raise ConfigError(
                f"memory state is for (capacity, shape, policy, selection, rank_past, "
                f"current_share) = {theirs}, "
                f"this memory is {mine}"
            )
        s = int(d["size"])
        if not 0 <= s <= self.capacity or d["x"].shape[0] != s:
            raise ConfigError(f"memory state has an inconsistent size {s}")
        dev = self.device
        self.size, self.seen = s, int(d["seen"])
        task = d.get("current_task", _OPTIONAL_STATE["current_task"])
        self.current_task = None if task is None else int(task)
        self.current_seen = int(d.get("current_seen", _OPTIONAL_STATE["current_seen"]))
        self.x[:s] = d["x"].to(dev, self.x.dtype)
        self.y[:s] = d["y"].to(dev)
        self.task[:s] = d["task"].to(dev)
        self.score[:s] = d["score"].to(dev)
        self.score_version[:s] = d["score_version"].to(dev)
        self.score_version[s:] = -1
        self._y_host[:s] = on_host(d["y"])
        self._task_host[:s] = on_host(d["task"])
        self._version_host[:s] = on_host(d["score_version"])
        self._version_host[s:] = -1
        self._classes = on_host(d["classes"]).astype(np.int64)
        self._priority = on_host(d["priority"]).astype(np.float32)
        self._gen.set_state(d["generator"])


@dataclass(frozen=True)
class MemorySpec:
    """What a learner's memory is, before the first batch tells its sample shape: `build`
    allocates it."""

    capacity: int
    policy: type[ReplayMemory]
    """The policy's memory class (`memory_policies.POLICIES` names it)."""
    selection: Selection
    device: torch.device
    rank_past: bool = False
    grouping: Grouping = field(default_factory=ClassBalanced)
    current_share: str = "equal"
    rescore: str = "on_change"

    def build(self, sample_shape: tuple[int, ...], seed: int) -> ReplayMemory:
        """An empty memory for samples of `sample_shape`, its generator seeded with `seed`."""
        return self.policy(self.capacity, sample_shape, self.selection, self.device, seed,
                           rank_past=self.rank_past, grouping=self.grouping,
                           current_share=self.current_share, rescore=self.rescore)
