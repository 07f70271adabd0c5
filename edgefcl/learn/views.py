"""What a client's collaborators read of it, as protocols: the scoring snapshot
(`scoring.snapshot.ClientOnnx`) and the stream monitor (`drift.StreamMonitor`) see the learner
through `LearnerView`, the method hooks (`objectives`, `variational`) and the run's reports see the
federated client through `ClientView`. They name what each needs, so that none imports the
learner or the client it serves (imports only go down: learner and client import them)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import torch

from edgefcl.config import FedConfig, LearnConfig


class LearnerView(Protocol):
    """The online learner (`learner.StreamLearner`), as its collaborators see it."""

    cid: str
    model: torch.nn.Module
    learn: LearnConfig
    device: torch.device
    perturber: Any
    sample_shape: tuple[int, ...] | None
    score_model: torch.nn.Module | None
    score_version: int
    clock: Any
    timings: Counter[str]
    protos: Any


class ClientView(LearnerView, Protocol):
    """The federated client (`client.Client`), as method hooks and reports see it."""

    fed: FedConfig
    encoder: Any
    version: int
    base: Any
    gen: torch.Generator
    batches: int
    samples_in_task: int
    monitor: Any
