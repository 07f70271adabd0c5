"""The Python API: an online continual learner with river's interface, and `simulate` for
whole fleets.

```python
import edgefcl

learner = edgefcl.Learner(classes=10)       # a fixed head over labels 0..9
learner.learn_many(X, y, task=0)            # one mini-batch, seen once
learner.predict_many(X_test)                # labels
run = edgefcl.simulate(edgefcl.RunConfig())  # the demo fleet, in process: a RunResult
```

The learner is the one every fleet client runs (BI-ranked replay memory, TTA scoring), built
from the same `LearnConfig` the CLI fills, with the same checks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike

from edgefcl.build import new_client
from edgefcl.config import ConfigError, FedConfig, LearnConfig, RunConfig, resolve_head
from edgefcl.data.types import Batch
from edgefcl.federation.heads import HEADS
from edgefcl.learn.bayes import predict_logits
from edgefcl.learn.client import Client
from edgefcl.learn.model_heads import head_of, library_model_head
from edgefcl.learn.models import build_model
from edgefcl.learn.variational import client_hooks
from edgefcl.outcomes.report import run_dir, summarize, write_run, write_summary
from edgefcl.outcomes.results import RunResult
from edgefcl.runner import run_many, total_runs
from edgefcl.sim.runs import simulate as simulate_one

__all__ = ["Learner", "RunResult", "simulate", "summarize", "sweep"]


def simulate(cfg: RunConfig) -> RunResult:
    """One run of `cfg` in process (lock-step, or async on the virtual clock with its
    `profile`): its method, its seed. The same config gives the same `global_sha256`. With
    `cfg.out`, its results, config, global and plots are written there, as `edgefcl simulate
    --out` writes them. A config with `compare` or `seeds` > 1 is a sweep: ConfigError, use
    `sweep`."""
    if cfg.compare or cfg.seeds > 1:
        raise ConfigError("simulate runs one method and one seed; edgefcl.sweep(cfg) runs "
                          "every method of compare for every seed (a RunResult each)")
    result = simulate_one(cfg)
    if cfg.out:
        write_run(result, Path(cfg.out))
    return result


def sweep(cfg: RunConfig) -> list[RunResult]:
    """Every method of `cfg.compare` (or its method) for `cfg.seeds` seeds from `cfg.seed`,
    in process, as `edgefcl simulate --compare ... --seeds N` runs them: a RunResult each, in
    that order (labelled by its compare entry). With `cfg.out`, each run's folder is written
    as it finishes and the summary (results.json, comparison.png) at the end, as the CLI
    writes them. `summarize` gives their mean ± sample std per method."""
    out = Path(cfg.out) if cfg.out else None
    several = total_runs(cfg) > 1 or bool(cfg.compare)  # else one run's layout, as the CLI
    results = run_many(cfg, on_done=None if out is None else (
        lambda r: write_run(r, run_dir(out, r) if several else out)))
    if out is not None and several:
        write_summary(results, out)
    return results


class Learner:
    """An online continual learner over one stream, shaped like a river classifier.

    `classes` fixes the label set to the integers 0..classes-1; without it the learner keeps
    a prototype library and takes labels of any value (integers or strings) as they come.
    Each `learn_many` call is one mini-batch, trained on once with replay from the memory.
    A task boundary is the `task` argument; with `LearnConfig(task_free=True)` a drift
    detector finds the boundaries instead. The model is built on the first call, from the
    shape of its samples (vectors, or images as (C, H, W)).
    """

    def __init__(self, classes: int | None = None, learn: LearnConfig | None = None,
                 seed: int = 0, fed: FedConfig | None = None) -> None:
        self.learn = learn if learn is not None else LearnConfig()
        if classes is not None and classes < 1:
            raise ConfigError(f"classes must be >= 1, got {classes}")
        if classes is None and self.learn.task_free:
            raise ConfigError("task_free needs a fixed label set: give classes")
        self.classes = classes
        self.seed = seed
        self.fed = fed if fed is not None else FedConfig()
        self.task = 0
        self._client: Client | None = None
        self._labels: dict[str, object] = {}  # prototype head: label name -> label as given
        self._shape: tuple[int, ...] | None = None  # a sample's shape, set by the first batch

    @property
    def client(self) -> Client | None:
        """The federated client wrapping this learner (None before the first batch): what
        `edgefcl client` runs, for code that exchanges updates itself."""
        return self._client

    def _build(self, x: np.ndarray) -> None:
        torch.manual_seed(self.seed)
        if self.classes is not None and HEADS[resolve_head(self.learn.head,
                                                          self.learn.method)].library:
            raise ConfigError(f"method {self.learn.method} uses the prototype head: leave "
                              "classes out")
        le = self.learn
        model = build_model(le.model, tuple(x.shape[1:]), self.classes or 1, le.hidden,
                            le.bn_momentum)
        if self.classes is None:
            model = library_model_head().wrap(model)
        model = client_hooks(le.method, le, self.fed).prepare_model(model)
        kind = "image" if x.ndim == 4 else "vector"
        self._client = new_client("local", model, le, self.fed, kind, self.seed)

    def _arrays(self, X: ArrayLike, y: ArrayLike | None = None
                ) -> tuple[np.ndarray, np.ndarray | None]:
        x = np.ascontiguousarray(X, dtype=np.float32)
        if x.ndim < 2:
            raise ValueError(f"X must hold a batch of samples (N, ...), got shape {x.shape}")
        if self._shape is not None and x.shape[1:] != self._shape:
            raise ValueError(f"X's samples have shape {x.shape[1:]}; this learner was built "
                             f"for {self._shape} by its first batch")
        if y is None:
            return x, None
        labels = np.asarray(y)
        if labels.shape != (len(x),):
            raise ValueError(f"y must hold one label per sample ({len(x)}), got shape "
                             f"{labels.shape}")
        return x, labels

    def learn_many(self, X: ArrayLike, y: ArrayLike, task: int | None = None) -> None:
        """Learn from one mini-batch `X` (N samples) with labels `y`, once. `task`: the task
        it belongs to (default: the task of the last call, 0 at first)."""
        x, labels = self._arrays(X, y)
        if self.classes is not None:
            if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= self.classes:
                raise ValueError(f"labels must be integers in 0..{self.classes - 1}; leave "
                                 "classes out for labels of any value")
            labels = labels.astype(np.int64)
        else:
            for value in np.unique(labels).tolist():
                self._labels.setdefault(str(value), value)
        if self._client is None:
            self._build(x)
            self._shape = tuple(x.shape[1:])
        learner = self._client.learner
        if task is not None and task != self.task:
            self.task = int(task)
        index = learner.batch_in_task + 1 if learner.task == self.task else 1
        learner.learn_one(Batch(x, labels, self.task, index, False))

    def learn_one(self, x: ArrayLike, y: object, task: int | None = None) -> None:
        """Learn from one sample (a mini-batch of one)."""
        self.learn_many(np.asarray(x)[None], np.asarray([y]), task)

    @torch.no_grad()
    def predict_proba_many(self, X: ArrayLike) -> np.ndarray:
        """Class probabilities, shape (N, classes); with the prototype head the columns
        follow `labels`."""
        if self._client is None:
            raise ValueError("the learner has not seen any data: call learn_many first")
        x, _ = self._arrays(X)
        model = self._client.learner.model
        was_training = model.training
        model.eval()
        try:
            logits = predict_logits(model, torch.from_numpy(x).to(self._client.learner.device),
                                    self.learn.eval_samples)
        finally:
            model.train(was_training)
        return torch.softmax(logits, 1).cpu().numpy()

    @property
    def labels(self) -> list:
        """The labels the columns of `predict_proba_many` stand for."""
        if self.classes is not None:
            return list(range(self.classes))
        if self._client is None:
            return []
        model = self._client.learner.model
        names = head_of(model).labels(model)
        assert names is not None
        return [self._labels[name] for name in names]

    def predict_many(self, X: ArrayLike) -> np.ndarray:
        """The most likely label of each sample."""
        proba = self.predict_proba_many(X)
        labels = np.asarray(self.labels)
        return labels[proba.argmax(1)]

    def predict_one(self, x: ArrayLike) -> object:
        """The most likely label of one sample."""
        return self.predict_many(np.asarray(x)[None])[0]

