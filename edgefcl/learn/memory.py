"""Fixed-size replay memory: reservoir (ER), class-balanced random (CBR) and class-balanced
uncertainty-ranked (BI and the other scores) population policies.

All storage is preallocated on one torch device and every update is vectorized over the
candidates (no per-sample Python loops). An update's plan (the groups, their allotments and
the candidates that need a score) is worked out on the host in numpy from the small label
arrays, where torch's per-operation cost dominated; the samples stay on the device. All
randomness comes from one `torch.Generator` seeded at construction, so a run is
reproducible for a seed and survives a `state_dict()` / `load_state_dict()` round-trip
(device reboots).

Class-balanced update (docs/algorithms.md §1, step 2), when a batch does not fit any more:
candidates = memory + batch. The per-class allotment is water-filling: the largest integer q
with sum_c min(n_c, q) <= capacity; classes with n_c <= q keep all their candidates, over-quota
classes keep q each and the leftover slots go one each to over-quota classes in a fixed random
priority order (drawn once per class, when its label is first offered), so the memory stays
exactly full (with `current_share="stream"` the current task's classes are first capped at
the task's share of the samples offered so far: `stream_paced`). Which candidates an
over-quota class keeps: under "balanced-score", for the
over-quota classes of the current task (and of past tasks too with `rank_past`), the
`selection` rule (`edgefcl.learn.selection`); otherwise uniformly at random.

Only candidates whose keep/drop depends on a score are scored: those of ranked over-quota
classes (never while the memory fills, never a class at or under its allotment). A cached score
is reused when it came from the current scoring `version` (past-task classes reuse any cached
score: their samples were scored while their task was current), or from any version with
`keep_stale`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from edgefcl.config import CURRENT_SHARES, ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.memory_policies import MemoryPolicy, get_policy
from edgefcl.learn.selection import Candidates, Selection, get_selection

UNIFORM = get_selection("random")
"""How every class that no rule ranks is cut: a uniform draw."""
MAX_NEW_GROUPS_AHEAD = 3
"""New groups in one batch up to which `pending_scores` plans ahead (2^k plans for k)."""
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

Scorer = Callable[[Tensor], Tensor]
"""Maps a stacked batch of samples (m, *sample_shape) to m uncertainty scores."""
Featurizer = Callable[[Tensor], Tensor]
"""Maps a stacked batch of samples (m, *sample_shape) to (m, d) features."""


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


@dataclass(frozen=True)
class MemorySpec:
    """What a learner's memory is, before the first batch tells its sample shape: `build`
    allocates it."""

    capacity: int
    policy: MemoryPolicy
    selection: Selection
    device: torch.device
    rank_past: bool = False
    grouping: Grouping = field(default_factory=ClassBalanced)
    current_share: str = "equal"

    def build(self, sample_shape: tuple[int, ...], seed: int) -> ReplayMemory:
        """An empty memory for samples of `sample_shape`, its generator seeded with `seed`."""
        return ReplayMemory(self.capacity, sample_shape, self.policy, self.selection,
                            self.device, seed, rank_past=self.rank_past, grouping=self.grouping,
                            current_share=self.current_share)


def _host(t: Tensor) -> np.ndarray:
    """t as a numpy array (a view for a CPU tensor)."""
    return t.detach().cpu().numpy()


@dataclass(frozen=True)
class _Plan:
    inv: Tensor  # (n,) class index of every candidate
    counts: Tensor  # (m,) candidates per class
    keep_n: Tensor  # (m,) allotment per class
    ranked: Tensor  # (m,) classes the selection rule decides
    need: Tensor  # candidates (memory slots, then batch rows) that need a score


class ReplayMemory:
    """A replay memory of `capacity` samples of shape `sample_shape` on `device`.

    policy: a `MemoryPolicy` or its name in `memory_policies.POLICIES`: "reservoir" (ER),
    "balanced-random" (CBR) or "balanced-score" (uncertainty ranked). selection (ranked
    policies only): a rule of `edgefcl.learn.selection` (or its name
    in `SELECTIONS`) applied to the over-quota groups of the current task, and of past tasks
    too when `rank_past`. grouping (balanced policies): how candidates are grouped and the
    capacity shared (`ClassBalanced` by default: classes, water-filling). current_share
    (balanced policies, one of `CURRENT_SHARES`): with `stream` the current task's classes
    keep at most the task's share of the samples offered so far, the past tasks' classes the
    rest.
    Filled slots are [0, size): x, y, task, score and score_version (-1: no score) hold them.
    """

    def __init__(
        self,
        capacity: int,
        sample_shape: tuple[int, ...],
        policy: str | MemoryPolicy,
        selection: Selection | str = "bottom",
        device: str | torch.device = "cpu",
        seed: int = 0,
        x_dtype: torch.dtype = torch.float32,
        rank_past: bool = False,
        grouping: Grouping | None = None,
        current_share: str = "equal",
    ) -> None:
        if capacity < 0:
            raise ConfigError(f"memory capacity must be >= 0, got {capacity}")
        policy = get_policy(policy)
        if current_share not in CURRENT_SHARES:
            raise ConfigError(f"unknown current_share '{current_share}'; choose from "
                              f"{CURRENT_SHARES}")
        self.rule = get_selection(selection) if isinstance(selection, str) else selection
        self.current_share = current_share
        self.grouping = grouping if grouping is not None else ClassBalanced()
        self.rank_past = bool(rank_past)
        self.capacity = int(capacity)
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.policy = policy
        self.selection = self.rule.name
        self.device = torch.device(device)
        self.size = 0
        self.seen = 0
        self.current_task: int | None = None  # the task of the last batch offered
        self.current_seen = 0  # samples of that task offered so far
        self.x = torch.zeros((self.capacity, *self.sample_shape), dtype=x_dtype, device=self.device)
        self.y = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.task = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.score = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)
        self.score_version = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        # Every group (class label) ever offered, sorted, and its leftover-slot priority.
        self._classes = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._priority = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(seed))
        # the plan `pending_scores` made, kept for the `update` that follows with the same
        # batch and arguments (nothing in between changes the memory): (key, labels, plan or
        # None when update must make it again, the candidates it asked to score)
        self._ahead: tuple[tuple, np.ndarray, _Plan | None, Tensor] | None = None

    # ------------------------------------------------------------------ queries

    def sample(self, n: int, exclude_task: int | None = None) -> tuple[Tensor, Tensor] | None:
        """Uniform draw of min(n, eligible) filled slots without replacement, skipping slots
        of `exclude_task`; returns (x, y), or None when no slot is eligible or n <= 0."""
        if n <= 0 or self.size == 0:
            return None
        if exclude_task is None:
            idx = torch.arange(self.size, device=self.device)
        else:
            idx = torch.nonzero(self.task[: self.size] != exclude_task).squeeze(1)
        if idx.numel() == 0:
            return None
        pick = torch.randperm(idx.numel(), generator=self._gen, device=self.device)[:n]
        slots = idx[pick]
        return self.x[slots], self.y[slots]

    def class_counts(self) -> dict[int, int]:
        """Number of stored samples per class label (classes with none are left out)."""
        labels, counts = torch.unique(self.y[: self.size], return_counts=True)
        return dict(zip(labels.tolist(), counts.tolist(), strict=True))

    # ------------------------------------------------------------------ update

    def update(
        self,
        x: Tensor,
        y: Tensor,
        task: int,
        scorer: Scorer | None = None,
        version: int = 0,
        rescore_all: bool = False,
        featurizer: Featurizer | None = None,
        keep_stale: bool = False,
        scores: Tensor | None = None,
    ) -> int:
        """Offer a mini-batch (x, y) of `task`; returns the number of samples scored.

        For a ranked policy ("balanced-score"), `scorer` is called at most once, on the
        stacked candidates of ranked over-quota classes that need a score: those without a
        cached score, or with one from another `version` for current-task classes (every one
        if `rescore_all`; none with a cached score if `keep_stale`). `scores`, when given,
        are the scores of `pending_scores(...)` with the same arguments, computed ahead; the
        scorer is then not called. `featurizer` (rules that need features) is called at
        most once, on the candidates of ranked classes. x is stored as x_dtype.
        """
        x, y = self._check_batch(x, y)
        b = y.numel()
        if b == 0:
            return 0
        if self.policy.ranked and scorer is None:
            raise ConfigError(f"a '{self.policy.name}' memory needs a scorer in update()")
        if not self.policy.balanced:
            self._reservoir(x, y, task)
            return 0
        self._note_classes(self._groups(_host(y), task))
        scored = 0
        if self.size + b <= self.capacity:
            sl = slice(self.size, self.size + b)
            self.x[sl], self.y[sl], self.task[sl] = x, y, task
            self.score[sl], self.score_version[sl] = 0.0, -1
            self.size += b  # nothing is dropped: no score decides anything
        elif self.capacity > 0:
            scored = self._balanced(x, y, task, scorer, version, rescore_all, featurizer,
                                    keep_stale, scores)
        self.current_seen = self._task_seen(task) + b
        self.current_task = task
        self.seen += b
        return scored

    def _task_seen(self, task: int) -> int:
        """Samples of `task` offered before this batch (0 unless it is the last batch's task)."""
        return self.current_seen if task == self.current_task else 0

    def _check_batch(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
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
        if y.numel() and int(y.min()) < 0:
            raise DataError("labels must be >= 0")
        return x.detach().to(self.device, self.x.dtype), y

    def _groups(self, y: np.ndarray, task: int) -> np.ndarray:
        """The group of every sample of a batch of `task` with labels `y`."""
        return self.grouping.key(y, np.full_like(y, task))

    def _known(self, groups: np.ndarray) -> np.ndarray:
        """Which of `groups` were offered before (a binary search of the sorted groups, far
        cheaper than np.isin on arrays this small)."""
        classes = _host(self._classes)
        if classes.size == 0:
            return np.zeros(groups.shape, dtype=bool)
        return classes[np.searchsorted(classes, groups).clip(max=classes.size - 1)] == groups

    def _note_classes(self, groups: np.ndarray) -> None:
        """Register groups never offered before, each with a random leftover priority."""
        unknown = ~self._known(groups)
        if not unknown.any():
            return
        new = np.unique(groups[unknown])
        prio = torch.rand(new.size, generator=self._gen, device=self.device)
        classes = torch.cat([self._classes, torch.from_numpy(new).to(self.device)])
        order = torch.argsort(classes)
        self._classes = classes[order]
        self._priority = torch.cat([self._priority, prio])[order]

    def _checked_scores(self, s: Tensor, n: int) -> Tensor:
        if not isinstance(s, Tensor) or tuple(s.shape) != (n,):
            shape = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise DataError(f"scorer must return a tensor of shape ({n},), got {shape}")
        s = s.detach().to(self.device, torch.float32)
        if not bool(torch.isfinite(s).all()):
            raise DataError("scorer returned NaN or Inf scores; check the scoring model")
        return s

    def _reservoir(self, x: Tensor, y: Tensor, task: int) -> None:
        """Sequential reservoir sampling over the batch, vectorized: sample number t (from 0)
        goes to slot t while t < capacity, else to slot j ~ U[0, t] if j < capacity; when
        several samples pick one slot the later one wins."""
        b = y.numel()
        t = self.seen + torch.arange(b, device=self.device, dtype=torch.int64)
        u = torch.rand(b, generator=self._gen, device=self.device, dtype=torch.float64)
        j = torch.minimum((u * (t + 1).to(torch.float64)).to(torch.int64), t)
        j = torch.where(t < self.capacity, t, j)
        self.seen += b
        hit = j < self.capacity
        if self.capacity == 0 or not bool(hit.any()):
            return
        winner = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        src = torch.arange(b, device=self.device)[hit]
        winner.scatter_reduce_(0, j[hit], src, reduce="amax")
        slots = torch.nonzero(winner >= 0).squeeze(1)
        rows = winner[slots]
        self.x[slots], self.y[slots], self.task[slots] = x[rows], y[rows], task
        self.size = min(self.seen, self.capacity)

    def pending_scores(
        self,
        x: Tensor,
        y: Tensor,
        task: int,
        version: int,
        rescore_all: bool = False,
        keep_stale: bool = False,
    ) -> Tensor | None:
        """The stacked candidates that `update` with these arguments will score (None when it
        scores none, or when which it scores depends on the leftover priorities it will draw
        for labels never offered before), computed without changing the memory or drawing
        random numbers: a caller can score them ahead (e.g. while it trains) and pass the
        scores to `update`."""
        if not self.policy.ranked or not self.rule.needs_scores:
            return None
        x, y = self._check_batch(x, y)
        if self.capacity == 0 or self.size + y.numel() <= self.capacity or y.numel() == 0:
            return None
        labels = _host(y).copy()
        groups = self._groups(labels, task)
        new = np.unique(groups[~self._known(groups)])
        key = self._plan_key(task, version, rescore_all, keep_stale)
        if new.size == 0:
            plan = self._plan(labels, task, version, rescore_all, keep_stale)
            need = plan.need
        else:
            need = self._need_whatever_priority(labels, task, version, rescore_all,
                                                keep_stale, new)
            if need is None:
                return None  # the new groups' priorities, drawn in update(), decide: score there
            plan = None  # made again in update(), with the priorities it draws
        self._ahead = (key, labels, plan, need)
        return self._stack(x, need, self.size) if need.numel() else None

    def _need_whatever_priority(self, y: np.ndarray, task: int, version: int,
                                rescore_all: bool, keep_stale: bool,
                                new: np.ndarray) -> Tensor | None:
        """The candidates needing a score when they are the same whatever leftover priorities
        `update` draws for the `new` groups, else None. An allotment that gives leftovers by
        priority rank (water-filling, `stream_paced`) decides each new group only by whether
        it ranks before the known groups it competes with or after them, so the plans with
        every new group's priority at either end (2^k of them) cover every draw; `update`
        checks the plan it makes against this one all the same."""
        if new.size > MAX_NEW_GROUPS_AHEAD:
            return None
        needs = [self._plan(y, task, version, rescore_all, keep_stale,
                            assumed=(new, np.array(ends, dtype=np.float32))).need
                 for ends in itertools.product((-1.0, 2.0), repeat=new.size)]
        return needs[0] if all(torch.equal(needs[0], n) for n in needs[1:]) else None

    def _plan_key(self, task: int, version: int, rescore_all: bool, keep_stale: bool) -> tuple:
        return (self.seen, self.size, task, version, rescore_all, keep_stale)

    def _planned(self, y: np.ndarray, task: int, version: int, rescore_all: bool,
                 keep_stale: bool) -> tuple[_Plan, Tensor | None]:
        """`_plan` (taken from the last `pending_scores` when it planned this very update) and
        the candidates that `pending_scores` asked to score for it (None: it did not)."""
        ahead, self._ahead = self._ahead, None
        if (ahead is not None and ahead[0] == self._plan_key(task, version, rescore_all,
                                                             keep_stale)
                and np.array_equal(ahead[1], y)):
            plan = ahead[2]
            if plan is None:
                plan = self._plan(y, task, version, rescore_all, keep_stale)
            return plan, ahead[3]
        return self._plan(y, task, version, rescore_all, keep_stale), None

    def _plan(self, y: np.ndarray, task: int, version: int, rescore_all: bool,
              keep_stale: bool, assumed: tuple[np.ndarray, np.ndarray] | None = None) -> _Plan:
        """Classes, allotments, ranked classes and the candidates needing a score (memory
        slots, then the batch's labels `y`), worked out on the host in numpy; `assumed`:
        (groups not offered yet, their leftover priorities) to plan as if they were known."""
        size, b = self.size, y.size
        yc = np.concatenate([_host(self.y[:size]), y])
        tc = np.concatenate([_host(self.task[:size]), np.full(b, task, dtype=np.int64)])
        labels, inv, counts = np.unique(self.grouping.key(yc, tc), return_inverse=True,
                                        return_counts=True)
        m = labels.size
        classes, priority = _host(self._classes), _host(self._priority)
        if assumed is not None:
            order = np.argsort(np.concatenate([classes, assumed[0]]))
            classes = np.concatenate([classes, assumed[0]])[order]
            priority = np.concatenate([priority, assumed[1]])[order]
        prio = priority[np.searchsorted(classes, labels)]
        keep_n = self.grouping.allot(counts, prio, self.capacity)
        # A class of the current task: any of its candidates belongs to `task`.
        current = np.zeros(m, dtype=bool)
        current[inv[tc == task]] = True
        if self.current_share == "stream" and not current.all():
            share = self.capacity * (self._task_seen(task) + b) // (self.seen + b)
            keep_n = stream_paced(counts, prio, current, share, self.grouping, self.capacity)
        ranked = np.zeros(m, dtype=bool)
        need = np.zeros(0, dtype=np.int64)
        if self.policy.ranked:
            ranked = (counts > keep_n) & (current | self.rank_past)
            if self.rule.needs_scores:
                vc = np.concatenate([_host(self.score_version[:size]),
                                     np.full(b, -1, dtype=np.int64)])
                if rescore_all:
                    valid = np.zeros(size + b, dtype=bool)
                elif keep_stale:
                    valid = vc >= 0
                else:
                    valid = (vc == version) | (~current[inv] & (vc >= 0))
                need = np.flatnonzero(ranked[inv] & ~valid)
        return _Plan(*(torch.from_numpy(a).to(self.device)
                       for a in (inv, counts, keep_n, ranked, need)))

    def _balanced(
        self,
        x: Tensor,
        y: Tensor,
        task: int,
        scorer: Scorer | None,
        version: int,
        rescore_all: bool,
        featurizer: Featurizer | None,
        keep_stale: bool,
        scores: Tensor | None = None,
    ) -> int:
        """Class-balanced selection over memory + batch; writes kept new samples into the
        evicted slots (and the free tail), so [0, capacity) is filled afterwards."""
        dev, size, cap, b = self.device, self.size, self.capacity, y.numel()
        n = size + b
        sc = torch.cat([self.score[:size], torch.zeros(b, device=dev)])
        vc = torch.cat([self.score_version[:size], torch.full_like(y, -1)])
        plan, need_ahead = self._planned(_host(y), task, version, rescore_all, keep_stale)
        if scores is not None and need_ahead is not None and not torch.equal(plan.need,
                                                                             need_ahead):
            scores = None  # scored ahead for other candidates than the drawn priorities need
        inv, counts, keep_n, ranked = plan.inv, plan.counts, plan.keep_n, plan.ranked

        scored = plan.need.numel()
        feats = None
        if scored:
            if scores is None:
                if scorer is None:
                    raise ConfigError("a 'balanced-score' memory needs a scorer in update()")
                scores = scorer(self._stack(x, plan.need, size))
            sc[plan.need] = self._checked_scores(scores, scored)
            vc[plan.need] = version
            self.score[:size], self.score_version[:size] = sc[:size], vc[:size]
        if self.policy.ranked and self.rule.needs_features:
            in_ranked = ranked[inv]
            if bool(in_ranked.any()):
                if featurizer is None:
                    raise ConfigError(f"selection '{self.rule.name}' needs a featurizer")
                idx = torch.nonzero(in_ranked).squeeze(1)
                f = featurizer(self._stack(x, idx, size)).detach().to(dev, torch.float32)
                feats = torch.zeros((n, *f.shape[1:]), device=dev)
                feats[idx] = f

        # Unranked classes: a uniform draw (the `random` rule), ranked ones: the memory's rule.
        keep = UNIFORM.select(Candidates(inv, counts, keep_n, sc, None, self._gen))
        if bool(ranked.any()):
            rule_keep = self.rule.select(Candidates(inv, counts, keep_n, sc, feats, self._gen))
            keep = torch.where(ranked[inv], rule_keep, keep)

        free = torch.cat(
            [torch.nonzero(~keep[:size]).squeeze(1), torch.arange(size, cap, device=dev)]
        )
        rows = torch.nonzero(keep[size:]).squeeze(1)
        self.x[free], self.y[free], self.task[free] = x[rows], y[rows], task
        self.score[free], self.score_version[free] = sc[size + rows], vc[size + rows]
        self.size = cap
        return scored

    def _stack(self, x: Tensor, idx: Tensor, size: int) -> Tensor:
        """Candidates `idx` (memory slots below `size`, then batch rows) stacked."""
        mem_idx, new_idx = idx[idx < size], idx[idx >= size] - size
        return torch.cat([self.x[mem_idx], x[new_idx]])

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (CPU tensors): filled slots, counters, classes, RNG."""

        def cpu(t: Tensor) -> Tensor:
            return t.detach().to("cpu", copy=True)

        s = self.size
        return {
            "capacity": self.capacity,
            "sample_shape": self.sample_shape,
            "policy": self.policy.name,
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
            "classes": cpu(self._classes),
            "priority": cpu(self._priority),
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the capacity, sample shape and policy must match."""
        missing = [k for k in _STATE_KEYS if k not in d]
        if missing:
            raise ConfigError(f"not a ReplayMemory state: missing {missing}")
        mine = (self.capacity, self.sample_shape, self.policy.name, self.selection,
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
        self._classes = d["classes"].to(dev, torch.int64)
        self._priority = d["priority"].to(dev, torch.float32)
        self._gen.set_state(d["generator"])
        self._ahead = None
