"""The scoring worker process: the same logits as scoring in the client's process, bit for
bit; a worker that dies, hangs up or cannot score leaves the client scoring on its own."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.messages import GlobalModel
from edgefcl.learn.client import Client
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors
from edgefcl.learn.scoring.snapshot import OnnxTemplate
from edgefcl.learn.scoring.worker import ScoreWorker, WorkerError, shared_worker

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {"image": (1, 8, 8), "vector": (6,)}


def _client(kind: str, process: bool, seed: int = 0) -> Client:
    torch.manual_seed(seed)
    model = build_model("cnn" if kind == "image" else "mlp", SHAPES[kind], 4)
    learn = LearnConfig(method="bi", memory_size=12, score_backend="onnxruntime",
                        score_process=process)
    return new_client("c007", model, learn, FedConfig(burn_in=0, jump=1), kind, seed=seed)


def _batches(kind: str, n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [Batch(rng.random((8, *SHAPES[kind]), dtype=np.float32), rng.integers(0, 4, 8), 0,
                  i + 1, False) for i in range(n)]


def _run(c: Client, kind: str, rounds: int = 3) -> list[np.ndarray]:
    """Scores of every scoring call of a short run with a global model each round."""
    c.learner.score_log = []
    for r in range(rounds):
        for b in _batches(kind, 3, seed=r):
            c.step(b)
        c.apply_global(GlobalModel(r + 1, get_tensors(c.model), ("c007",)))
    return [z.numpy() for z in c.learner.score_log]


def _started(c: Client) -> Client:
    """`c` once its scoring worker has started (before, the client scores on its own)."""
    deadline = time.monotonic() + 120
    while not c.onnx.worker.ready():
        assert time.monotonic() < deadline, "the scoring worker did not start"
        time.sleep(0.01)
    return c


@pytest.mark.parametrize("kind", ["image", "vector"])
def test_the_worker_scores_as_the_client_would_bit_for_bit(kind):
    worker, here = _started(_client(kind, True)), _client(kind, False)
    assert worker.onnx.worker is not None and here.onnx.worker is None
    a, b = _run(worker, kind), _run(here, kind)
    assert len(a) == len(b) > 3
    for za, zb in zip(a, b, strict=True):
        np.testing.assert_array_equal(za, zb)
    np.testing.assert_array_equal(worker.learner.memory.score, here.learner.memory.score)
    assert worker.onnx.worker is not None and worker.onnx.worker.broken is None


def test_a_client_scores_on_its_own_until_the_worker_has_started(monkeypatch):
    # the demo waited 0.5-1.2 s for the worker's first answer while it imported torch
    worker, here = _client("image", True), _client("image", False)
    pool = worker.onnx.worker
    monkeypatch.setattr(pool, "ready", lambda: False)
    before = next(pool._ids)  # the worker is the process's: other tests used it too
    a = _run(worker, "image", rounds=2)
    asked = next(pool._ids)
    assert asked == before + 1  # nothing was sent to the worker while it was starting
    monkeypatch.undo()
    _started(worker)
    a += _run(worker, "image", rounds=2)
    assert next(pool._ids) > asked + 1  # then it scored
    b = _run(here, "image", rounds=2) + _run(here, "image", rounds=2)
    assert len(a) == len(b) > 3
    for za, zb in zip(a, b, strict=True):
        np.testing.assert_array_equal(za, zb)


def test_a_killed_worker_leaves_the_client_scoring_the_same():
    # the attack: the worker process dies between two scoring calls (out of memory, a kill)
    worker, here = _started(_client("image", True)), _client("image", False)
    for c in (worker, here):
        for b in _batches("image", 3):
            c.step(b)
        c.apply_global(GlobalModel(1, get_tensors(c.model), ("c007",)))
        c.learner.score_log = []
    proc = worker.onnx.worker._proc
    worker.step(_batches("image", 1, seed=5)[0])  # scored in the worker
    here.step(_batches("image", 1, seed=5)[0])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for b in _batches("image", 3, seed=6):
        worker.step(b)
        here.step(b)
    assert worker.onnx.worker is None  # fell back, with a warning
    a, b = worker.learner.score_log, here.learner.score_log
    assert len(a) == len(b) >= 2
    for za, zb in zip(a, b, strict=True):
        np.testing.assert_array_equal(za.numpy(), zb.numpy())
    assert shared_worker(1) is not None and shared_worker(1).broken is None  # a new one


def test_an_evicted_session_is_sent_again():
    model = build_model("mlp", (6,), 4)
    graph = OnnxTemplate(model, (6,)).with_weights(model.state_dict())
    worker = ScoreWorker(1)
    try:
        x = np.random.default_rng(0).random((5, 6), dtype=np.float32)
        spec = ("vector", 3, 0.1)
        first = worker.score("k", 1, graph, spec, "bi", x, 7, 256)[0]
        assert first.shape == (3, 5, 4)
        worker._known["other"] = 1  # as if the worker had dropped "other"'s session
        for key in ("other", "k"):
            np.testing.assert_array_equal(worker.score(key, 1, graph, spec, "bi", x, 7, 256)[0],
                                          first)
    finally:
        worker.close()


def test_a_request_the_worker_cannot_serve_is_an_error_not_a_hang():
    worker = ScoreWorker(1)
    try:
        x = np.zeros((2, 6), np.float32)
        with pytest.raises(WorkerError, match="could not score"):
            worker.score("k", 1, b"not an onnx graph", ("vector", 2, 0.1), "bi", x, 1, 256)[0]
        model = build_model("mlp", (6,), 4)
        graph = OnnxTemplate(model, (6,)).with_weights(model.state_dict())
        z = worker.score("k", 1, graph, ("vector", 2, 0.1), "bi", x, 1, 256)[0]  # still serving
        assert z.shape == (2, 2, 4) and worker.broken is None
    finally:
        worker.close()
    with pytest.raises(WorkerError):
        worker.score("k", 1, graph, ("vector", 2, 0.1), "bi", x, 1, 256)[0]


def test_the_worker_exits_when_the_client_hangs_up():
    worker = ScoreWorker(1)
    proc = worker._proc
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def test_a_client_that_exits_before_the_worker_started_leaves_no_traceback():
    # a client refused at its start (a finished run) exited before the worker said "ready":
    # the worker's write failed with a BrokenPipeError traceback on the operator's terminal
    proc = subprocess.Popen([sys.executable, "-m", "edgefcl.learn.scoring.worker", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the client is gone before the worker could say it started
    err = proc.communicate(timeout=120)[1].decode()  # closes its stdin too
    assert proc.returncode == 0 and "Traceback" not in err and "Exception" not in err, err


def test_a_process_stops_its_shared_worker_as_it_exits():
    # the demo left its worker running at exit: `python -W always` warned of the child
    code = ("from edgefcl.learn.scoring.worker import shared_worker\n"
            "w = shared_worker(1)\n"
            "while not w.ready(): pass\n")
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          timeout=120, text=True)
    assert done.returncode == 0 and "ResourceWarning" not in done.stderr, done.stderr


def test_score_process_off_or_torch_backend_starts_no_worker():
    c = _client("vector", False)
    assert c.onnx.worker is None
    learn = dataclasses.replace(LearnConfig(method="bi", memory_size=12), score_backend="torch")
    c = new_client("c007", build_model("mlp", (6,), 4), learn, FedConfig(burn_in=0, jump=1),
                   "vector", seed=0)
    assert c.onnx is None or c.onnx.worker is None
