"""Selection rules of the class-balanced memory: which candidates an over-quota class keeps.

A rule is one small object registered by name (`@register`), like Avalanche's buffer
selection strategies. The memory decides how many candidates every class keeps (water-filling)
and which classes are ranked; a rule then picks, for every class at once (vectorized, no
per-class Python loop), which candidates fill the class's allotment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from edgefcl.config import ConfigError


@dataclass(frozen=True)
class Candidates:
    """The candidates of one memory update, grouped by class.

    cls: (n,) class index of every candidate in [0, m); counts: (m,) candidates per class;
    keep: (m,) how many each class keeps (<= counts); score: (n,) uncertainty (larger = more
    uncertain; only meaningful in ranked classes); features: (n, d) penultimate features or
    None; generator: the memory's random generator (rules that draw must use it).
    """

    cls: Tensor
    counts: Tensor
    keep: Tensor
    score: Tensor
    features: Tensor | None
    generator: torch.Generator


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


SELECTIONS: dict[str, Selection] = {}
"""Rule name -> rule."""


def register(cls: type[Selection]) -> type[Selection]:
    """Class decorator: add one instance of the rule to `SELECTIONS` under its name."""
    SELECTIONS[cls.name] = cls()
    return cls


def get_selection(name: str) -> Selection:
    """The rule called `name`, or a ConfigError listing the known ones."""
    rule = SELECTIONS.get(name)
    if rule is None:
        raise ConfigError(f"unknown selection '{name}'; choose from {', '.join(SELECTIONS)}")
    return rule


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
