"""The registries of scores and methods. Both import nothing heavy (the config checks names
against them before torch loads): what needs torch is named by a reference "module:attribute",
loaded on first use.

- `SCORES`: the memory's uncertainty scores (a function (P, N, C) logits -> (N,), larger =
  more uncertain). Every score is also a method of the same name: a class-balanced memory
  ranked by that score.
- `METHODS`: every learning method: which memory it keeps, which score ranks it, its hooks
  (`edgefcl.learn.objectives.MethodHooks`: penalty, model transformation, bookkeeping), and
  the encoding / aggregation it implies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from edgefcl.config import NAMES, ConfigError
from edgefcl.learn.memory_policies import POLICIES

MEMORIES = tuple(POLICIES)
"""Names of the replay memory policies (`memory_policies.POLICIES`)."""


def load(ref: str) -> Any:
    """The object a reference "package.module:attribute" names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Score:
    """An uncertainty score of the replay memory."""

    name: str
    fn: str
    """Reference of the function, "module:function"."""
    help: str = ""


@dataclass(frozen=True)
class Method:
    """A learning method."""

    name: str
    memory: str | None
    """Memory policy (one of MEMORIES), or None: no replay memory."""
    score: str = "bi"
    """The score that ranks a balanced-score memory."""
    hooks: str = ""
    """Reference of its MethodHooks class ("module:Class"); empty: the plain client."""
    encoding: str = ""
    """The encoding it needs (and implies when none is given); empty: any."""
    aggregation: str = ""
    """The aggregation it implies with that encoding; empty: the encoding's default."""
    head: str = "fixed"
    """The head `--head auto` gives it: fixed (an output layer) or prototypes (a library)."""
    baseline: bool = False
    """A baseline of the memory study's bar (`bench/memory_study.py`): every other rule is measured
    against the baselines' forgetting and accuracy."""
    help: str = ""


SCORES: dict[str, Score] = {s.name: s for s in (
    Score("bi", "edgefcl.learn.scoring.scores:bregman_information", "Bregman information"),
    Score("lc", "edgefcl.learn.scoring.scores:least_confidence", "least confidence"),
    Score("ms", "edgefcl.learn.scoring.scores:one_minus_margin",
          "1 - margin of the top two classes"),
    Score("rc", "edgefcl.learn.scoring.scores:ratio", "ratio of the top two classes"),
    Score("en", "edgefcl.learn.scoring.scores:entropy", "entropy of the mean prediction"),
    Score("ag", "edgefcl.learn.scoring.scores:agreement", "1 - agreement of the views' argmax"),
)}



def scored_methods(scores: dict[str, Score]) -> dict[str, Method]:
    """One method per score: a class-balanced memory ranked by it."""
    return {s.name: Method(s.name, "balanced-score", score=s.name,
                           help=f"class-balanced memory ranked by {s.help}")
            for s in scores.values()}


METHODS: dict[str, Method] = {
    **scored_methods(SCORES),
    **{m.name: m for m in (
        Method("er", "reservoir", baseline=True, help="reservoir memory"),
        Method("cbr", "balanced-random", baseline=True, help="class-balanced random memory"),
        Method("fedavg", None, help="no memory"),
        Method("fedprox", None, hooks="edgefcl.learn.objectives:FedProx",
               help="no memory, proximal term to the last global"),
        Method("vfcl", "balanced-score", hooks="edgefcl.learn.variational:VFCLHooks",
               encoding="gaussian", aggregation="conflation",
               help="Bayesian, mixture prior; BI-ranked memory"),
        Method("fedbnn", "balanced-score", hooks="edgefcl.learn.variational:FedBNNHooks",
               encoding="gaussian", aggregation="fedbnn", head="prototypes",
               help="Bayesian, likelihood product; BI-ranked memory"),
        Method("apc", "balanced-random", hooks="edgefcl.learn.apc_layers:APC", encoding="apc",
               help="FedWeIT decomposition, class-balanced random memory"),
    )},
}

NAMES["methods"] = METHODS  # what configs check method names against


def get_method(name: str) -> Method:
    """The descriptor of method `name`; ConfigError listing the methods otherwise."""
    m = METHODS.get(name)
    if m is None:
        raise ConfigError(f"unknown method '{name}'; choose from {', '.join(METHODS)}")
    return m


def get_score(name: str) -> Score:
    """The descriptor of score `name`; ConfigError listing the scores otherwise."""
    s = SCORES.get(name)
    if s is None:
        raise ConfigError(f"unknown uncertainty method '{name}'; choose from "
                          f"{', '.join(SCORES)}")
    return s
