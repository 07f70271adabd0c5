"""The compiled training loss (`--compile-step`): a compiled step matches the eager one, shapes
it has not compiled run eager, and a compiler failure falls back to eager once and for all."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.learn import compiled_step
from edgefcl.learn.compiled_step import CompiledLoss, compile_step, plain_loss
from edgefcl.learn.model_heads import library_model_head
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors
from tests.learn.test_batched import CUDA, batch, close


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
    assert isinstance(compiled.learner.head.loss, CompiledLoss)
    assert eager.learner.head.loss is plain_loss
    # the first task's steps (5 samples) compile at their second use; the later ones (batch
    # and replay draw: 10 samples) exceed max_shapes and run eager
    loss = CompiledLoss(torch.device(device), compiled.learner.timings, min_uses=2,
                        max_shapes=1)
    compiled.learner.head.loss = loss
    for task, classes in ((0, [0, 1]), (1, [2, 3])):
        for i in range(4):
            for c in (eager, compiled):
                c.step(batch("cnn", task, i, classes, 0))
    assert loss.shapes == {((5, 1, 8, 8), torch.float32, (5,))}
    assert loss.compiled_steps == 4 * 3 - 1 and loss.eager_steps == 1 + 4 * 3
    ta, tb = get_tensors(eager.model), get_tensors(compiled.model)  # BatchNorm statistics too
    for name in ta:
        close(tb[name], ta[name], name)
    timings = compiled.learner.timings
    assert timings["compile"] > timings["train"] > 0  # compiling is not counted as training


def test_a_compiler_failure_falls_back_to_eager_once(monkeypatch, caplog) -> None:
    def broken(mode):
        def fail(*args):
            raise RuntimeError("no C++ compiler\nsecond line")
        return fail

    monkeypatch.setattr(compiled_step, "_compiled", broken)
    monkeypatch.setattr(compiled_step, "_SAID", set())
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, hidden=16)
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0])
    loss = CompiledLoss(torch.device("cpu"), Counter(), min_uses=1)
    with caplog.at_level(logging.WARNING, logger="edgefcl.learn.compiled_step"):
        values = [loss(model, x, y) for _ in range(3)]
    assert loss.failed and loss.compiled_steps == 0 and loss.eager_steps == 3
    for v in values:
        assert torch.equal(v, plain_loss(model, x, y))
    said = [r.getMessage() for r in caplog.records]
    assert said == ["compile-step: torch.compile failed (RuntimeError: no C++ compiler); "
                    "those steps run eager"]


@pytest.mark.parametrize("head", ["prototypes", "bayesian"])
def test_steps_it_cannot_compile_run_eager_and_say_why(head, monkeypatch, caplog) -> None:
    monkeypatch.setattr(compiled_step, "_SAID", set())
    torch.manual_seed(0)
    net = build_model("mlp", (6,), 4, hidden=16)
    if head == "prototypes":
        net = library_model_head().wrap(net)
        learn, fed = LearnConfig(head="prototypes", compile_step="on"), FedConfig()
    else:
        learn = LearnConfig(method="vfcl", compile_step="on")
        fed = FedConfig(encoding="gaussian", aggregation="conflation")
    with caplog.at_level(logging.WARNING, logger="edgefcl.learn.compiled_step"):
        client = new_client("c", net, learn, fed, "vector")
    assert not isinstance(getattr(client.learner.head, "loss", None), CompiledLoss)
    assert any("run eager" in r.getMessage() for r in caplog.records)
    client.step(batch("mlp", 0, 0, [0, 1], 0))
    assert np.isfinite(client.evaluate(*_xy()))


def _xy():
    b = batch("mlp", 0, 1, [0, 1], 0)
    return b.x, b.y
