"""The registry of classifier heads: one `Head` descriptor each, in `HEADS`. `--head auto` gives
a method its own (`Method.head`, `config.resolve_head`); the code that acts on a head asks its
descriptor, never its name. A head whose classes are label rows (`Head.rows`) brings its
federation rule here: the first library of a run, the check of a device's rows and the round's
fold (`RowsRule`); the learning side registers in `learn/model_heads.py`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgefcl.config import NAMES, FedConfig, RunConfig, resolve_head
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import Update
from edgefcl.federation.prototype_library import PrototypeRows


class RowsRule(Protocol):
    """The federation side of a head whose classes are rows keyed by label name."""

    def width(self, tensors: dict[str, np.ndarray]) -> int:
        """Row width of the library of an extractor with these global tensors."""

    def initial(self, tensors: dict[str, np.ndarray], gaussian: bool) -> LabelRows:
        """The first global library of a run."""

    def check(self, sent: LabelRows | None, held: LabelRows | None) -> str | None:
        """Why a device's library is refused against the global's (None: accepted)."""

    def fold(self, updates: Sequence[Update], previous: LabelRows, owners: dict[str, str],
             fed: FedConfig, label_cap: int, counters: Counter, by_likelihood: bool = False,
             prior_sigma: float | None = None,
             combine: Callable[[np.ndarray], np.ndarray] | None = None
             ) -> tuple[LabelRows, dict[str, str]]:
        """The round's library and the labels' owners."""


@dataclass(frozen=True)
class Head:
    """A classifier head."""

    name: str
    rows: RowsRule | None
    """The rule of its label rows: its classes are rows of a library keyed by label name
    (labels travel as names, the library with updates and globals); None: an output layer
    indexed by class number."""
    help: str

    @property
    def library(self) -> bool:
        """Whether its classes are rows of a library keyed by label name."""
        return self.rows is not None


HEADS: dict[str, Head] = {h.name: h for h in (
    Head("fixed", None, "an output layer sized from the dataset's classes"),
    Head("prototypes", PrototypeRows(), "FedBNN's prototype library: rows keyed by label name"),
)}
NAMES["heads"] = HEADS  # what configs check head names against


def head_rows(cfg: RunConfig) -> RowsRule | None:
    """The rows rule of `cfg`'s head; None for a head without a library (or an unknown one,
    which the config refuses)."""
    head = HEADS.get(resolve_head(cfg.learn.head, cfg.learn.method))
    return None if head is None else head.rows


def library_head(cfg: RunConfig) -> bool:
    """Whether a run of `cfg` keeps a library of label rows."""
    return head_rows(cfg) is not None


def rows_rule() -> RowsRule:
    """The rule of a library the aggregator holds, where no run configuration is at hand: that
    of the registered library head (label rows do not name their head; a second library head
    would have to)."""
    rules = [h.rows for h in HEADS.values() if h.rows is not None]
    if len(rules) != 1:
        raise RuntimeError(f"{len(rules)} library heads registered: label rows must name theirs")
    return rules[0]


def initial_library(cfg: RunConfig, tensors: dict[str, np.ndarray],
                    gaussian: bool) -> LabelRows | None:
    """The first global library of a run of `cfg` (Gaussian rows when `gaussian`: a Bayesian
    encoding), or None for a head without one."""
    rule = head_rows(cfg)
    return None if rule is None else rule.initial(tensors, gaussian)


def library_width(cfg: RunConfig, tensors: dict[str, np.ndarray]) -> int | None:
    """Row width of `cfg`'s library for an extractor with these tensors (None: no library)."""
    rule = head_rows(cfg)
    return None if rule is None else rule.width(tensors)
