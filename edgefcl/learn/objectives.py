"""Method hooks: what a learning method adds to the plain online client (a loss penalty,
task-boundary and global-merge bookkeeping, a model transformation).

`make_hooks(method, learn)` returns the hooks object of a method (or the no-op base).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgefcl.config import LearnConfig
from edgefcl.learn.methods import get_method, load
from edgefcl.learn.views import ClientView

if TYPE_CHECKING:
    from edgefcl.federation.messages import GlobalModel


class MethodHooks:
    """No-op hooks; methods override what they need."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Transform the freshly built model (e.g. into a Bayesian one)."""
        return model

    def attach(self, client: ClientView) -> None:
        """Called once the client is built."""

    def penalty(self, client: ClientView) -> torch.Tensor | None:
        """Extra loss term for a training step (None: nothing)."""
        return None

    def on_task_start(self, client: ClientView, task: int) -> None:
        """Called when the first mini-batch of a new task arrives."""

    def on_global(self, client: ClientView, g: GlobalModel) -> None:
        """Called after the client merged a global model."""

    def plain_training(self) -> bool:
        """Whether a training step is the plain loss of the unchanged model (no penalty, no
        transformed model), so that clients' steps may be stacked (`learn/batched.py`)."""
        cls = type(self)
        return cls.penalty is MethodHooks.penalty and cls.prepare_model is MethodHooks.prepare_model


class FedProx(MethodHooks):
    """FedProx: (mu / 2) * ||w - w_global||^2 against the last global merged."""

    def __init__(self, learn: LearnConfig) -> None:
        self.mu = learn.fedprox_mu
        self.anchor: dict[str, torch.Tensor] = {}

    def _snapshot(self, client: ClientView) -> None:
        self.anchor = {n: p.detach().clone() for n, p in client.model.named_parameters()}

    def attach(self, client: ClientView) -> None:
        self._snapshot(client)

    def penalty(self, client: ClientView) -> torch.Tensor:
        terms = [((p - self.anchor[n]) ** 2).sum() for n, p in client.model.named_parameters()]
        return 0.5 * self.mu * torch.stack(terms).sum()

    def on_global(self, client: ClientView, g: GlobalModel) -> None:
        self._snapshot(client)


def make_hooks(method: str, learn: LearnConfig) -> MethodHooks:
    """The hooks of `method` (its descriptor's `hooks`; plain MethodHooks when it has none)."""
    ref = get_method(method).hooks
    return load(ref)(learn) if ref else MethodHooks()
