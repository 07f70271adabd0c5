"""The learner's classifier head, as the learner sees it (`ClassifierHead`), and the fixed
output layer (`FixedHead`). The prototype library's head (`learn/proto_train.PrototypeHead`,
`--head prototypes`) is the other implementation, built by its `learn/model_heads.py` entry
(`ModelHead.trainer`); the learner holds one or the other and never asks which (the registry of
heads: `federation/heads.py`, its learning side `learn/model_heads.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from torch import Tensor, nn

from edgefcl.learn.compiled_step import Loss, plain_loss
from edgefcl.learn.optimizers import LocalOptimizer


class ClassifierHead(Protocol):
    """What the learner asks of its head in the online step, the scoring snapshot,
    checkpoints and evaluation."""

    @property
    def empty(self) -> bool:
        """Whether it knows no class yet (evaluation then scores 0)."""

    def ids(self, y: np.ndarray) -> np.ndarray:
        """The class ids of a batch's labels."""

    def warmup(self, x: Tensor, y: Tensor) -> None:
        """Before training on a batch: fit what new labels need."""

    def train_step(self, xb: Tensor, yb: Tensor, opt: LocalOptimizer,
                   penalty: Callable[[], Tensor | None]) -> None:
        """One optimizer step on (xb, yb), with the method's `penalty` added to the loss."""

    def count(self, y_ids: np.ndarray) -> None:
        """After a batch: count its labels."""

    def snapshot_into(self, snapshot: Any) -> None:
        """Give the scoring snapshot (a copy of the model) the head's current classifier."""

    def state(self, snapshot: Any) -> dict | None:
        """What a checkpoint keeps of the head (None: nothing)."""

    def load(self, state: dict, snapshot: Any) -> None:
        """Restore a `state()`."""

    def targets(self, y: np.ndarray) -> np.ndarray:
        """The model output index of each label of `y` (-1: none)."""


class FixedHead:
    """The model's own output layer, indexed by class number: labels must be integers, and
    the step is the plain loss (`loss`: compiled by `--compile-step`, `learn/compiled_step.py`)."""

    empty = False

    def __init__(self, model: nn.Module, loss: Loss = plain_loss) -> None:
        self.model = model
        self.loss = loss

    def ids(self, y: np.ndarray) -> np.ndarray:
        """`y` itself; ValueError for labels that are not integers (names)."""
        if y.dtype.kind not in "iu":
            raise ValueError(f"labels of dtype {y.dtype} (names) need the prototype head: "
                             "use --head prototypes")
        return y

    def warmup(self, x: Tensor, y: Tensor) -> None:
        """Nothing to fit: every class has its output from the start."""

    def train_step(self, xb: Tensor, yb: Tensor, opt: LocalOptimizer,
                   penalty: Callable[[], Tensor | None]) -> None:
        """Cross-entropy of the model's outputs (plus the penalty), one optimizer step."""
        loss = self.loss(self.model, xb, yb)
        extra = penalty()
        if extra is not None:
            loss = loss + extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def count(self, y_ids: np.ndarray) -> None:
        """Nothing to count."""

    def snapshot_into(self, snapshot: Any) -> None:
        """The snapshot's copy of the output layer is its classifier already."""

    def state(self, snapshot: Any) -> None:
        """Nothing beyond the model's own state."""
        return None

    def load(self, state: dict, snapshot: Any) -> None:
        """Nothing to restore."""

    def targets(self, y: np.ndarray) -> np.ndarray:
        """Class numbers are output indices."""
        return y
