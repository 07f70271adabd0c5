"""What an in-process run (lock-step or async) ends with: per-task accuracy, message sizes
and the `RunResult`, shared by the lock-step and the async simulators."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from edgefcl.build import Setup
from edgefcl.config import RunConfig
from edgefcl.data.types import TaskData
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.learn.client import Client
from edgefcl.learn.compiled_step import step_counts
from edgefcl.learn.drift import stream_report
from edgefcl.learn.export import architecture_spec, global_state
from edgefcl.learn.params import global_sha256
from edgefcl.outcomes.metrics import CommStats, label_coverage
from edgefcl.outcomes.results import RunResult, cfg_dict
from edgefcl.transport import codec


def evaluate_all(client: Client, tasks: list[TaskData]) -> np.ndarray:
    """Accuracy of the client's model on every task's test data."""
    return np.array([client.evaluate(t.x_test, t.y_test) for t in tasks])


def run_result(cfg: RunConfig, method: str, seed: int, setup: Setup, clients: list[Client],
               agg: Aggregator, acc: np.ndarray, coverage: np.ndarray, comm: CommStats,
               start: float, **extra: object) -> RunResult:
    """The result of a finished in-process run (lock-step or async)."""
    g = agg.global_
    return RunResult(method, seed, acc, agg.rounds, comm, global_sha256(g.tensors, g.prototypes),
                     cfg_dict(cfg, method, seed), time.perf_counter() - start,
                     {"scored_samples": int(sum(c.scored for c in clients)),
                      "batches": int(sum(c.batches for c in clients)),
                      "timings": dict(sum((c.timings for c in clients), Counter())),
                      "background_timings": dict(sum((c.background for c in clients),
                                                     Counter())),
                      "aggregator": dict(agg.counters),
                      "model_spec": architecture_spec(cfg.learn.model, setup.dataset.sample_shape,
                                               setup.dataset.n_classes, cfg.learn.hidden),
                      "labels": (list(g.prototypes.labels) if g.prototypes is not None
                                 else setup.dataset.labels),  # prototypes: library order
                      **label_coverage(coverage, clients[0].protos is not None),
                      **stream_report(clients), **extra,
                      **step_counts(c.learner.loss for c in clients)},
                     global_state=global_state(clients[0], g))


def encoded_size(msg: Update | GlobalModel, cfg: RunConfig) -> int:
    """Bytes the message occupies on the wire: its msgpack payload as the codec encodes it."""
    wire = "<f2" if cfg.mqtt.wire_dtype == "float16" else None
    return len(codec.encode(msg, fleet=cfg.mqtt.fleet, wire_dtype=wire))
