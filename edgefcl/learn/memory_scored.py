"""The score-ranked class-balanced policy ("balanced-score": BI and the other scores).

The allotment is `memory_balanced`'s. Which candidates an over-quota class keeps: for the
over-quota classes of the current task (and of past tasks too with `rank_past`), the
`selection` rule (`edgefcl.learn.selection`); for the others a uniform draw.

Only candidates whose keep/drop depends on a score are scored: those of ranked over-quota
classes (never while the memory fills, never a class at or under its allotment). With
`rescore="on_change"` a cached score is reused when it came from the current scoring
`version` (past-task classes reuse any cached score: their samples were scored while their
task was current); with "never" any cached score is reused, with "always" none. An update's
plan (the groups, their allotments and the candidates that need a score) can be made ahead
(`pending_scores`), so that a caller scores while it trains.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.memory import Featurizer, Replacement, Scoring
from edgefcl.learn.memory_balanced import BalancedMemory
from edgefcl.learn.selection import Candidates

MAX_NEW_GROUPS_AHEAD = 3
"""New groups in one batch up to which `pending_scores` plans ahead (2^k plans for k)."""


@dataclass(frozen=True)
class _Plan:
    inv: Tensor  # (n,) class index of every candidate
    counts: Tensor  # (m,) candidates per class
    keep_n: Tensor  # (m,) allotment per class
    ranked: Tensor  # (m,) classes the selection rule decides
    need: Tensor  # candidates (memory slots, then batch rows) that need a score
    need_host: np.ndarray  # the same on the host
    any_ranked: bool


class BalancedScoreMemory(BalancedMemory):
    """Class-balanced, over-quota classes ranked by an uncertainty score (`selection`,
    `rank_past`, `rescore`); every update needs a `Scoring`."""

    name = "balanced-score"
    scored = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the plan `pending_scores` made, kept for the `update` that follows with the same
        # batch and version (nothing in between changes the memory): (key, labels, plan or
        # None when update must make it again, the candidates it asked to score)
        self._ahead: tuple[tuple, np.ndarray, _Plan | None, np.ndarray] | None = None

    def _offer(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
               scoring: Scoring | None) -> int:
        if scoring is None:
            raise ConfigError(f"a '{self.name}' memory needs a scorer in update()")
        return super()._offer(x, y, labels, task, scoring)

    def _replace(self, x: Tensor, y: Tensor, labels: np.ndarray, task: int,
                 scoring: Scoring | None) -> Replacement:
        assert scoring is not None  # checked by _offer
        size = self.size
        sc, vc, versions = self._cached_scores(y)
        plan, need_ahead = self._planned(labels, task, scoring.version)
        scores = scoring.scores
        if (scores is not None and need_ahead is not None
                and not np.array_equal(plan.need_host, need_ahead)):
            scores = None  # scored ahead for other candidates than the drawn priorities need
        scored = plan.need.numel()
        unchecked = None
        if scored:
            if scores is None:
                scores = scoring.scorer(self._stack(x, plan.need, size))
            # checked for NaN with the choice, where they are: host scores (the scoring
            # worker's) never wait, and a fleet's memories check theirs in one read
            unchecked = self._shaped_scores(scores, scored)
            sc[plan.need] = unchecked.to(self.device, torch.float32)
            vc[plan.need] = scoring.version
            versions[plan.need_host] = scoring.version
        feats = (self._features(x, plan, scoring.featurizer) if self.rule.needs_features
                 else None)
        # Unranked classes: a uniform draw (the `random` rule), ranked ones: the memory's rule.
        ranked = ((self.rule, Candidates(plan.inv, plan.counts, plan.keep_n, sc, feats,
                                         self._gen), plan.ranked[plan.inv])
                  if plan.any_ranked else None)

        def write(kept: np.ndarray) -> None:
            if scored:  # the memory's slots keep their new scores
                self.score[:size], self.score_version[:size] = sc[:size], vc[:size]
                self._version_host[:size] = versions[:size]
            self._keep(x, y, labels, task, kept, sc, vc, versions)

        return Replacement(Candidates(plan.inv, plan.counts, plan.keep_n, sc, None, self._gen),
                           ranked, write, scored, unchecked)

    def _features(self, x: Tensor, plan: _Plan, featurizer: Featurizer | None) -> Tensor | None:
        """(n, d) features of the candidates of ranked classes (zeros elsewhere); None when no
        class is ranked."""
        if not plan.any_ranked:  # a ranked class has candidates: over its allotment
            return None
        in_ranked = plan.ranked[plan.inv]
        if featurizer is None:
            raise ConfigError(f"selection '{self.rule.name}' needs a featurizer")
        idx = torch.nonzero(in_ranked).squeeze(1)
        f = featurizer(self._stack(x, idx, self.size)).detach().to(self.device, torch.float32)
        feats = torch.zeros((plan.inv.numel(), *f.shape[1:]), device=self.device)
        feats[idx] = f
        return feats

    @staticmethod
    def _shaped_scores(s: Tensor, n: int) -> Tensor:
        if not isinstance(s, Tensor) or tuple(s.shape) != (n,):
            shape = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise DataError(f"scorer must return a tensor of shape ({n},), got {shape}")
        return s.detach()

    def _stack(self, x: Tensor, idx: Tensor, size: int) -> Tensor:
        """Candidates `idx` (memory slots below `size`, then batch rows) stacked."""
        mem_idx, new_idx = idx[idx < size], idx[idx >= size] - size
        return torch.cat([self.x[mem_idx], x[new_idx]])

    # ------------------------------------------------------------------ the plan

    def pending_scores(self, x: Tensor, y: Tensor, task: int, version: int,
                       labels: np.ndarray | None = None) -> Tensor | None:
        """The stacked candidates that `update` with this batch and scoring `version` will
        score (None when it scores none, or when which it scores depends on the leftover
        priorities it will draw for labels never offered before), computed without changing
        the memory or drawing random numbers: a caller can score them ahead (e.g. while it
        trains) and pass the scores in `Scoring.scores`. `labels`: y on the host, as for
        `update`."""
        if not self.rule.needs_scores:
            return None
        x, y, labels = self._check_batch(x, y, labels)
        if self.capacity == 0 or self.size + y.numel() <= self.capacity or y.numel() == 0:
            return None
        labels = labels.copy()
        groups = self._groups(labels, task)
        new = np.unique(groups[~self._known(groups)])
        if new.size == 0:
            plan = self._plan(labels, task, version)
            need = plan.need_host
        else:
            need = self._need_whatever_priority(labels, task, version, new)
            if need is None:
                return None  # the new groups' priorities, drawn in update(), decide: score there
            plan = None  # made again in update(), with the priorities it draws
        self._ahead = (self._plan_key(task, version), labels, plan, need)
        return (self._stack(x, torch.from_numpy(need).to(self.device), self.size) if need.size
                else None)

    def _need_whatever_priority(self, y: np.ndarray, task: int, version: int,
                                new: np.ndarray) -> np.ndarray | None:
        """The candidates needing a score when they are the same whatever leftover priorities
        `update` draws for the `new` groups, else None. An allotment that gives leftovers by
        priority rank (water-filling, `stream_paced`) decides each new group only by whether
        it ranks before the known groups it competes with or after them, so the plans with
        every new group's priority at either end (2^k of them) cover every draw; `update`
        checks the plan it makes against this one all the same."""
        if new.size > MAX_NEW_GROUPS_AHEAD:
            return None
        needs = [self._plan(y, task, version, (new, np.array(ends, dtype=np.float32))).need_host
                 for ends in itertools.product((-1.0, 2.0), repeat=new.size)]
        return needs[0] if all(np.array_equal(needs[0], n) for n in needs[1:]) else None

    def _plan_key(self, task: int, version: int) -> tuple:
        return (self.seen, self.size, task, version)

    def _planned(self, y: np.ndarray, task: int, version: int
                 ) -> tuple[_Plan, np.ndarray | None]:
        """`_plan` (taken from the last `pending_scores` when it planned this very update) and
        the candidates that `pending_scores` asked to score for it (None: it did not)."""
        ahead, self._ahead = self._ahead, None
        if (ahead is not None and ahead[0] == self._plan_key(task, version)
                and np.array_equal(ahead[1], y)):
            plan = ahead[2]
            if plan is None:
                plan = self._plan(y, task, version)
            return plan, ahead[3]
        return self._plan(y, task, version), None

    def _plan(self, y: np.ndarray, task: int, version: int,
              assumed: tuple[np.ndarray, np.ndarray] | None = None) -> _Plan:
        """The allotment (`_allot`, `assumed` passed on), the ranked classes and the
        candidates needing a score (memory slots, then the batch's labels `y`)."""
        a = self._allot(y, task, assumed)
        ranked = (a.counts > a.keep) & (a.current | self.rank_past)
        need = np.zeros(0, dtype=np.int64)
        if self.rule.needs_scores:
            vc = np.concatenate([self._version_host[:self.size],
                                 np.full(y.size, -1, dtype=np.int64)])
            if self.rescore == "always":
                valid = np.zeros(vc.size, dtype=bool)
            elif self.rescore == "never":
                valid = vc >= 0
            else:
                valid = (vc == version) | (~a.current[a.inv] & (vc >= 0))
            need = np.flatnonzero(ranked[a.inv] & ~valid)
        return _Plan(*(torch.from_numpy(v).to(self.device)
                       for v in (a.inv, a.counts, a.keep, ranked, need)),
                     need_host=need, any_ranked=bool(ranked.any()))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self._ahead = None
