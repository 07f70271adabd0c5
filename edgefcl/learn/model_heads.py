"""The learning side of the classifier heads: one `ModelHead` each in `MODEL_HEADS`, keyed by the
names of `federation/heads.py` `HEADS` (which holds what the federation needs to know of a head,
and may not import learn/). Building a run, a client, the `edgefcl.api` learner or an exported
model asks these hooks, never the head's name nor the model's class; this is the one module
outside the prototype head's own (`proto_net`, `proto_train`) that knows it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edgefcl.config import LearnConfig, RunConfig, resolve_head
from edgefcl.federation.heads import HEADS
from edgefcl.federation.label_rows import LabelRows
from edgefcl.learn.proto_net import ProtoNet, proto_model
from edgefcl.learn.proto_train import PrototypeHead


@dataclass(frozen=True)
class ModelHead:
    """What building a model and a client needs of a classifier head."""

    name: str
    wrap: Callable[[nn.Module], nn.Module]
    """A freshly built model (output layer included) as this head's model."""
    owns: Callable[[nn.Module], bool]
    """Whether a model is this head's (what `wrap` made)."""
    trainer: Callable[[nn.Module, LearnConfig, torch.device, float | None],
                      PrototypeHead | None]
    """The client's side of the head for its model, optimiser settings, device and initial row
    sigma (None: point rows); None: the learner's own `FixedHead`."""
    empty_table: Callable[[nn.Module, bool], LabelRows | None]
    """The first global prototype library for a model (Gaussian rows if the flag is set);
    None: the head keeps no library."""
    labels: Callable[[nn.Module], list[str] | None]
    """The label names of the model's output columns; None: class numbers are the columns."""
    load_rows: Callable[[nn.Module, Sequence[str], np.ndarray], None]
    """Put a saved global library (labels, rows) into a model; a head with no library has
    nothing to load."""


def _none(*_: object) -> None:
    return None


def _proto_trainer(model: nn.Module, learn: LearnConfig, device: torch.device,
                   sigma: float | None) -> PrototypeHead:
    assert isinstance(model, ProtoNet)
    return PrototypeHead(model, learn.optimizer, learn.lr, device, learn.warmup_steps,
                         not learn.prototypes_local, sigma)


def _proto_table(model: nn.Module, bayesian: bool) -> LabelRows:
    assert isinstance(model, ProtoNet)
    return LabelRows.empty(model.dim + 1, bayesian)


def _proto_labels(model: nn.Module) -> list[str]:
    assert isinstance(model, ProtoNet)
    return model.library.labels


def _proto_load_rows(model: nn.Module, labels: Sequence[str], rows: np.ndarray) -> None:
    assert isinstance(model, ProtoNet)
    model.library.ensure(list(labels))
    model.library.rows = torch.from_numpy(np.asarray(rows, np.float32))


FIXED = ModelHead("fixed", wrap=lambda model: model, owns=lambda model: False, trainer=_none,
                  empty_table=_none, labels=_none, load_rows=_none)

MODEL_HEADS: dict[str, ModelHead] = {h.name: h for h in (
    FIXED,
    ModelHead("prototypes", wrap=proto_model, owns=lambda model: isinstance(model, ProtoNet),
              trainer=_proto_trainer, empty_table=_proto_table, labels=_proto_labels,
              load_rows=_proto_load_rows),
)}


def head_for(cfg: RunConfig) -> ModelHead:
    """The head a run of `cfg` uses (`--head auto`: its method's); an unknown head, which the
    config refuses, is the fixed one."""
    return MODEL_HEADS.get(resolve_head(cfg.learn.head, cfg.learn.method), FIXED)


def head_of(model: nn.Module) -> ModelHead:
    """The head that owns `model`; the fixed head when none does."""
    return next((h for h in MODEL_HEADS.values() if h.owns(model)), FIXED)


def library_model_head() -> ModelHead:
    """The head whose classes are rows of a label-keyed library (`federation` `Head.library`):
    what takes labels of any value, with no class count up front."""
    return next(MODEL_HEADS[name] for name, head in HEADS.items() if head.library)
