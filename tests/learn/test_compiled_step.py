"""The compiled training loss (`--compile-step`): compiled steps match eager ones, shapes it has
not compiled run eager, and a compiler failure falls back to eager once and for all."""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from edgefcl.build import new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.learn import compiled_step
from edgefcl.learn.batched import FleetTrainer
from edgefcl.learn.compiled_step import CompiledLoss, compile_step, plain_loss, step_counts
from edgefcl.learn.model_heads import library_model_head
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors
from tests.learn.test_batched import CUDA, assert_same_clients, batch, clients, close


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test sees the process as new: nothing compiled, broken or said yet (dynamo's
    caches too: a shape another test compiled would make no new graph, read as a failure)."""
    for name in ("_READY", "_BROKEN", "_SAID"):
        monkeypatch.setattr(compiled_step, name, set())
    torch._dynamo.reset()


def cnn_client(cid: str, compiled: str = "off", device: str = "cpu"):
    torch.manual_seed(0)
    net = build_model("cnn", (1, 8, 8), 4)  # BatchNorm: running statistics updated in the step
    return new_client(cid, net, LearnConfig(memory_size=20, local_epochs=3, device=device,
                                            compile_step=compiled),
                      FedConfig(burn_in=2, jump=2), "image", seed=0)


def test_auto_compiles_on_cuda_only() -> None:
    assert not compile_step(LearnConfig(device="cpu"))
    assert compile_step(LearnConfig(device="cuda"))
    assert compile_step(LearnConfig(device="cpu", compile_step="on"))
    assert not compile_step(LearnConfig(device="cuda", compile_step="off"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_compiled_steps_match_eager_and_other_shapes_run_eager(device) -> None:
    """On CUDA the compiled step replays CUDA graphs (mode reduce-overhead)."""
    eager, compiled = cnn_client("a", device=device), cnn_client("b", "on", device)
    assert isinstance(compiled.learner.loss, CompiledLoss)
    assert eager.learner.loss is plain_loss
    loss = CompiledLoss(torch.device(device), compiled.learner.timings, min_uses=2)
    compiled.learner.loss = compiled.learner.head.loss = loss
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    # two shapes compile at their second use: the first task's steps (5 samples), the later
    # ones (batch and replay draw: 10); a last, short batch (3 + 3) runs eager
    spent = 0.0  # the compiled client's steps, wall time

    def step(b) -> None:
        nonlocal spent
        eager.step(b)
        t0 = time.perf_counter()
        compiled.step(b)
        spent += time.perf_counter() - t0

    for task, classes in ((0, [0, 1]), (1, [2, 3])):
        for i in range(4):
            step(batch("cnn", task, i, classes, 0))
    step(batch("cnn", 1, 4, [2, 3], 0, n=3))
    assert {s[0][0] for s in loss.shapes} == {5, 10}
    assert step_counts([loss, plain_loss]) == {"compiled_steps": 2 * 11, "eager_steps": 2 + 3}
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo did compile
    assert counters["inductor"]["cudagraph_skips"] == skips  # and CUDA graphs were not skipped
    ta, tb = get_tensors(eager.model), get_tensors(compiled.model)  # BatchNorm statistics too
    for name in ta:
        close(tb[name], ta[name], name)
    timings = compiled.learner.timings
    assert timings["compile"] > 0 and timings["train"] > 0
    assert timings["train"] + timings["compile"] <= spent  # compiling is not training too


def _mlp_step(**kw):
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, hidden=16)
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0])
    return model, x, y, CompiledLoss(torch.device("cpu"), Counter(), min_uses=1, **kw)


def test_a_compiler_failure_falls_back_to_eager_for_the_process(monkeypatch, caplog) -> None:
    def broken(fn, mode):
        def fail(*args):
            raise RuntimeError("no C++ compiler\nsecond line")
        return fail

    monkeypatch.setattr(compiled_step, "_compiled", broken)
    model, x, y, loss = _mlp_step()
    other = _mlp_step()[3]  # another client of the process: it does not try again
    with caplog.at_level(logging.WARNING, logger="edgefcl.learn.compiled_step"):
        values = [loss(model, x, y) for _ in range(3)] + [other(model, x, y)]
    assert step_counts([loss, other]) == {"compiled_steps": 0, "eager_steps": 4}
    for v in values:
        assert torch.equal(v, plain_loss(model, x, y))
    assert [r.getMessage() for r in caplog.records] == [
        "compile-step: torch.compile failed (RuntimeError: no C++ compiler); those steps run "
        "eager"]


def test_a_compile_that_makes_no_graph_is_a_failure(monkeypatch, caplog) -> None:
    """torch runs eager past its recompile limit, with no error: no new graph tells."""
    monkeypatch.setattr(compiled_step, "graphs_compiled", lambda: 0)
    model, x, y, loss = _mlp_step()
    with caplog.at_level(logging.WARNING, logger="edgefcl.learn.compiled_step"):
        assert torch.equal(loss(model, x, y), plain_loss(model, x, y))
    assert loss.eager_steps == 1 and loss.compiled_steps == 0 and not loss.shapes
    assert "made no graph" in caplog.records[0].getMessage()


@pytest.mark.parametrize("head", ["prototypes", "bayesian"])
def test_steps_it_cannot_compile_run_eager_and_say_why(head, caplog) -> None:
    torch.manual_seed(0)
    net = build_model("mlp", (6,), 4, hidden=16)
    if head == "prototypes":
        net = library_model_head().wrap(net)
        learn, fed = LearnConfig(head="prototypes", compile_step="on"), FedConfig()
    else:
        learn = LearnConfig(method="vfcl", compile_step="on")
        fed = FedConfig(encoding="gaussian", aggregation="conflation")
    with caplog.at_level(logging.INFO, logger="edgefcl.learn.compiled_step"):
        client = new_client("c", net, learn, fed, "vector")
    assert client.learner.loss is plain_loss
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "run eager" in caplog.records[0].getMessage()
    client.step(batch("mlp", 0, 0, [0, 1], 0))
    b = batch("mlp", 0, 1, [0, 1], 0)
    assert np.isfinite(client.evaluate(b.x, b.y))


@pytest.mark.parametrize("model,device", [
    ("mlp", "cpu"), pytest.param("cnn", "cpu", marks=pytest.mark.slow),
    pytest.param("cnn", "cuda", marks=CUDA)])
def test_a_compiled_stacked_step_matches_the_eager_one(model, device) -> None:
    """With --compile-step and --batch-clients the stacked step compiles too (its steady
    shapes, by the clients' own policy): each client ends where the eager stacked step leaves
    it, BatchNorm statistics and optimizer state included, and the compile time is the
    clients' compile time, not their training."""
    eager = clients(model, device=device)
    compiled = clients(model, device=device, compile_step="on")
    for c in compiled:  # compile a shape at its second use
        c.learner.loss = c.learner.head.loss = CompiledLoss(torch.device(device),
                                                            c.learner.timings, min_uses=2)
    plain, fast = FleetTrainer(), FleetTrainer()
    graphs = counters["stats"]["unique_graphs"]
    ticks = [(0, i, [0, 1]) for i in range(1, 5)] + [(1, i, [2, 3]) for i in range(1, 4)]
    for task, i, classes in ticks:
        batches = [batch(model, task, i, classes, k) for k in range(3)]
        plain.step(eager, batches)
        fast.step(compiled, batches)
    assert_same_clients(eager, compiled)
    # 3 local steps a tick: the first tick's shape (no replay yet) compiles at its second
    # step, the later shape (batch and replay draw) likewise: 2 of 21 steps run eager; each
    # client counts its stacked steps as its own
    assert step_counts(c.learner.loss for c in compiled) == {"compiled_steps": 3 * 19,
                                                           "eager_steps": 3 * 2}
    assert fast.stacked_steps == 3 * 7
    assert counters["stats"]["unique_graphs"] > graphs
    for c in compiled:
        assert c.learner.timings["compile"] > 0


def test_a_stacked_step_that_cannot_compile_leaves_the_clients_own_compiled(
        monkeypatch) -> None:
    """vmap of a model may fail to compile where the model alone compiles: the stacked steps
    run eager from then on, each client's own steps still compile."""
    real = compiled_step._compiled

    def picky(fn, mode):
        if fn is not compiled_step.stacked_loss:
            return real(fn, mode)

        def fail(*args):
            raise RuntimeError("vmap not supported")
        return fail

    compiled = clients("mlp", compile_step="on")
    for c in compiled:
        c.learner.loss = c.learner.head.loss = CompiledLoss(torch.device("cpu"),
                                                            c.learner.timings, min_uses=2)
    monkeypatch.setattr(compiled_step, "_compiled", picky)
    trainer = FleetTrainer()
    for i in range(1, 4):
        trainer.step(compiled, [batch("mlp", 0, i, [0, 1], k) for k in range(3)])
    assert trainer.stacked_steps == 9
    assert step_counts(c.learner.loss for c in compiled)["compiled_steps"] == 0
    for i in range(4, 9):  # client 0 alone: its own compiled loss
        compiled[0].step(batch("mlp", 0, i, [0, 1], 0))
    assert compiled[0].learner.loss.compiled_steps > 0
