"""Selection rules of the class-balanced memory: which candidates an over-quota class keeps.

A rule is one small object listed by name in `SELECTIONS` (`edgefcl.learn.selection`), like
Avalanche's buffer selection strategies. The memory decides how many candidates every class
keeps (water-filling) and which classes are ranked; a rule then picks, for every class at
once (vectorized, no per-class Python loop), which candidates fill the class's allotment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Candidates:
    """The candidates of one memory update, grouped by class.

    cls: (n,) class index of every candidate in [0, m); counts: (m,) candidates per class;
    keep: (m,) how many each class keeps (<= counts); score: (n,) uncertainty (larger = more
    uncertain; only meaningful in ranked classes); features: (n, d) penultimate features or
    None; generator: the memory's random generator (rules that draw use `uniform`); segments:
    the memories' generators and candidate counts, in order, when several memories' candidates
    are stacked (`memory_fleet`; empty: one memory's).
    """

    cls: Tensor
    counts: Tensor
    keep: Tensor
    score: Tensor
    features: Tensor | None
    generator: torch.Generator
    segments: tuple[tuple[torch.Generator, int], ...] = ()

    def uniform(self) -> Tensor:
        """(n,) uniform draws, each memory's candidates' from its own generator (the draws it
        makes alone)."""
        dev = self.cls.device
        if not self.segments:
            return torch.rand(self.cls.numel(), generator=self.generator, device=dev)
        return torch.cat([torch.rand(n, generator=g, device=dev) for g, n in self.segments])


class Selection(ABC):
    """Picks `keep[c]` candidates of every class c; returns an (n,) bool mask."""

    name: str = ""
    needs_scores: bool = True
    """Whether the rule reads `score` (the memory scores the candidates it ranks)."""
    needs_features: bool = False
    """Whether the rule reads `features` (penultimate features of the scoring model)."""

    @abstractmethod
    def select(self, c: Candidates) -> Tensor:
        """Boolean mask of the kept candidates: exactly keep[c] per class c."""


class FeatureSelection(Selection):
    """A rule that picks in feature space (penultimate features), without scores."""

    needs_scores = False
    needs_features = True

    def features(self, c: Candidates) -> Tensor:
        """The candidates' features as float (n, d); ValueError when the memory gave none."""
        if c.features is None:
            raise ValueError(f"{self.name} needs candidate features")
        return c.features.float().flatten(1)


def grouped_rank(cls: Tensor, key: Tensor, counts: Tensor) -> Tensor:
    """Rank (from 0) of every candidate within its class by ascending `key` (ties: lower index
    first)."""
    n = cls.numel()
    order = torch.argsort(key, stable=True)
    order = order[torch.argsort(cls[order], stable=True)]
    start = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.int64, device=cls.device)
    rank[order] = torch.arange(n, device=cls.device) - start[cls[order]]
    return rank


def class_means(c: Candidates, f: Tensor) -> Tensor:
    """(m, d) mean of the rows of `f` within every class of `c`."""
    mean = torch.zeros(c.counts.numel(), f.shape[1], device=f.device).index_add_(0, c.cls, f)
    return mean / c.counts.unsqueeze(1).to(f.dtype)


def greedy_per_class(c: Candidates, cost: Callable[[Tensor], Tensor],
                     picked: Callable[[Tensor, Tensor], None]) -> Tensor:
    """Greedy selection in every class at once: each step keeps, in every class with room left,
    the unkept candidate of lowest `cost(taken)` (ties: the lowest index), then calls
    `picked(picks, taken)` so that the rule updates what its costs depend on. `taken` (m,)
    counts the candidates kept per class so far. Returns the (n,) kept mask."""
    n, m, dev = c.cls.numel(), c.counts.numel(), c.cls.device
    idx = torch.arange(n, device=dev)
    kept = torch.zeros(n, dtype=torch.bool, device=dev)
    taken = torch.zeros(m, dtype=torch.int64, device=dev)
    inf = torch.tensor(float("inf"), device=dev)
    for _ in range(int(c.keep.max()) if m else 0):
        want = (taken < c.keep)[c.cls] & ~kept
        if not bool(want.any()):
            break
        costs = torch.where(want, cost(taken), inf)
        best = torch.full((m,), float("inf"), device=dev).scatter_reduce(
            0, c.cls, costs, reduce="amin")
        hit = want & (costs == best[c.cls])
        first = torch.full((m,), n, device=dev).scatter_reduce(
            0, c.cls, torch.where(hit, idx, n), reduce="amin")
        picks = first[first < n]
        kept[picks] = True
        taken[c.cls[picks]] += 1
        picked(picks, taken)
    return kept
