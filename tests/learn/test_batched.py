"""Fleet-batched training: a stacked step of many clients matches each client's own step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefcl.build import make_optimizer, new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.learn.batched import FleetTrainer, stackable
from edgefcl.learn.drift import peek_logits
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors

CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def clients(model="mlp", method="bi", optimizer="adam", k=3, device="cpu", **learn):
    out = []
    for i in range(k):
        torch.manual_seed(i)
        net = (build_model("mlp", (6,), 4, hidden=16) if model == "mlp"
               else build_model("cnn", (1, 8, 8), 4))
        kind = "vector" if model == "mlp" else "image"
        out.append(new_client(f"c{i}", net, LearnConfig(method=method, memory_size=20,
                                                        local_epochs=3, optimizer=optimizer,
                                                        device=device, **learn),
                              FedConfig(burn_in=2, jump=2), kind, seed=i))
    return out


def batch(model, task, index, classes, k, n=5):
    rng = np.random.default_rng(1000 * k + 100 * task + index)
    y = rng.choice(classes, n).astype(np.int64)
    shape = (n, 6) if model == "mlp" else (n, 1, 8, 8)
    x = (rng.standard_normal(shape) + y.reshape(-1, *([1] * (len(shape) - 1)))).astype(np.float32)
    return Batch(x, y, task, index, False)


def close(actual, expected, what):
    """Relative distance of two tensors at most 1e-4: elementwise bounds do not hold for Adam,
    whose first step on a near-zero gradient is +-lr whatever the gradient's float noise."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    gap = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12)
    assert gap < 1e-4, (what, gap)


def assert_same_clients(alone, together):
    for a, b in zip(alone, together, strict=True):
        ta, tb = get_tensors(a.model), get_tensors(b.model)  # parameters and BN statistics
        for name in ta:
            close(tb[name], ta[name], name)
        sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for key in sa[i]:
                close(sb[i][key].cpu().numpy(), sa[i][key].cpu().numpy(), key)
        assert a.learner.batches == b.learner.batches and a.seq == b.seq
        assert a.memory.size == b.memory.size


@pytest.mark.parametrize("model,optimizer,device", [
    ("mlp", "adam", "cpu"), ("mlp", "sgd", "cpu"), ("cnn", "adam", "cpu"),
    pytest.param("cnn", "adam", "cuda", marks=CUDA)])
def test_stacked_steps_match_each_clients_own_steps(model, optimizer, device):
    """The first tick (no optimizer state yet) and a tick with replay in the second task: the
    stacked step matches each client's own within float tolerance. (Over many ticks the two
    drift apart as any two float orders do: Adam magnifies the noise of near-zero gradients.)"""
    alone = clients(model, optimizer=optimizer, device=device)
    together = clients(model, optimizer=optimizer, device=device)
    trainer = FleetTrainer()
    ticks = [(0, i, [0, 1]) for i in range(1, 7)] + [(1, i, [2, 3]) for i in range(1, 5)]
    for n, (task, i, classes) in enumerate(ticks):
        batches = [batch(model, task, i, classes, k) for k in range(3)]
        sent = [c.step(b) is not None for c, b in zip(alone, batches, strict=True)]
        if n in (0, len(ticks) - 1):
            sent_together = [u is not None for u in trainer.step(together, batches)]
            assert sent_together == sent
            assert_same_clients(alone, together)
        else:  # one after another, as the sequential path: both stay bit for bit the same
            for c, b in zip(together, batches, strict=True):
                c.step(b)
    assert trainer.stacked_steps == 6 and trainer.alone_steps == 0
    assert together[0].memory.size > 0 and together[0].seq > 0


@pytest.mark.parametrize("model,device", [
    ("mlp", "cpu"), ("cnn", "cpu"), pytest.param("cnn", "cuda", marks=CUDA)])
def test_the_monitors_check_of_stacked_clients_is_each_clients_own(model, device):
    """The prequential check before training, from one stacked eval-mode forward: each
    client's logits match its own `peek_logits` (BatchNorm with its own running statistics)
    and its counts are the ones it makes alone."""
    alone, together = clients(model, device=device), clients(model, device=device)
    shape = (8, 6) if model == "mlp" else (8, 1, 8, 8)
    with torch.no_grad():  # different running statistics per client
        for k, (a, b) in enumerate(zip(alone, together, strict=True)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(k)) * (k + 1)
            a.model.train()(x.to(device))
            b.model.train()(x.to(device))
    batches = [batch(model, 0, 1, [0, 1], k) for k in range(3)]
    xs = torch.stack([torch.from_numpy(b.x).to(device) for b in batches])
    got = FleetTrainer().peek_stacked([c.model for c in together], xs)
    for k, c in enumerate(alone):
        close(got[k].cpu(), peek_logits(c.model, xs[k]).cpu(), "logits")
    assert all(c.model.training for c in together)  # modes untouched
    for c, b in zip(alone, batches, strict=True):
        c.step(b)
    FleetTrainer().step(together, batches)
    for a, b in zip(alone, together, strict=True):
        pa, pb = a.learner.monitor.prequential, b.learner.monitor.prequential
        assert (pa.correct, pa.samples) == (pb.correct, pb.samples) and pa.samples == 5
        assert b.learner.timings["monitor"] > 0


@pytest.mark.parametrize("model,device", [
    ("mlp", "cpu"), ("cnn", "cpu"), pytest.param("cnn", "cuda", marks=CUDA)])
def test_stacked_scoring_gives_each_client_its_own_scores(model, device):
    """The test-time views of every client's candidates, scored in one stacked forward of the
    clients' snapshots (candidate counts padded): each client's logits match the ones its own
    scoring thread computes, and its memory keeps the same samples."""
    alone, together = (clients(model, device=device, score_backend="torch") for _ in range(2))
    for c in alone + together:
        c.learner.score_log = []
    for i in range(1, 5):  # fill the memories (20 each), one client after another
        for cs in (alone, together):
            for k, c in enumerate(cs):
                c.step(batch(model, 0, i, [0, 1], k))
    for c in alone + together:
        c.learner.snapshot()  # a frozen scoring model: scores can be asked ahead
    trainer = FleetTrainer()
    for task, i, classes in [(0, i, [0, 1]) for i in range(5, 8)] + [(1, 1, [2, 3])]:
        batches = [batch(model, task, i, classes, k, n=5 if k else 3) for k in range(3)]
        for c, b in zip(alone, batches, strict=True):
            c.step(b)
        trainer.step(together, batches)
    assert trainer.stacked_scores > 0
    for a, b in zip(alone, together, strict=True):
        assert len(a.learner.score_log) == len(b.learner.score_log) > 0
        for la, lb in zip(a.learner.score_log, b.learner.score_log, strict=True):
            close(lb, la, "logits")
        assert torch.equal(a.memory.y[:a.memory.size], b.memory.y[:b.memory.size])
        assert b.learner.timings["score"] > 0


def test_a_client_that_cannot_be_stacked_steps_alone():
    fedprox = clients(method="fedprox", k=2)
    assert not any(stackable(c) for c in fedprox)
    trainer = FleetTrainer()
    trainer.step(fedprox, [batch("mlp", 0, 1, [0, 1], k) for k in range(2)])
    assert trainer.alone_steps == 2 and trainer.stacked_steps == 0


def test_clients_with_different_shapes_are_grouped_by_shape():
    cs = clients()
    trainer = FleetTrainer()
    batches = [batch("mlp", 0, 1, [0, 1], k, n=5 if k < 2 else 3) for k in range(3)]
    trainer.step(cs, batches)
    assert trainer.stacked_steps == 2 and trainer.alone_steps == 1


@pytest.mark.parametrize("model,device", [
    ("mlp", "cpu"), ("cnn", "cpu"), pytest.param("cnn", "cuda", marks=CUDA)])
def test_stacked_evaluation_gives_each_client_its_own_accuracy(model, device):
    """Each client's accuracies on its own test sets from stacked eval-mode forwards in
    chunks (BatchNorm with its own running statistics): what it gets alone. A client whose
    sets have other sizes, and one that cannot stack, evaluate alone."""
    cs = clients(model, k=4, device=device) + clients(model, method="fedprox", k=1,
                                                      device=device)
    shape = (8, 6) if model == "mlp" else (8, 1, 8, 8)
    with torch.no_grad():  # different weights and running statistics per client
        for k, c in enumerate(cs):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(k)) * (k + 1)
            c.model.train()(x.to(device))
    for c, b in zip(cs, [batch(model, 0, 1, [0, 1], k) for k in range(5)], strict=True):
        c.step(b)
    tests = [[(b.x, b.y) for b in (batch(model, t, 9, [0, 1, 2, 3], k, n=37 if k < 3 else 11)
                                   for t in range(3))] for k in range(5)]
    trainer = FleetTrainer()
    got = trainer.evaluate(cs, tests, chunk=16, stack=True)
    for c, sets, acc in zip(cs, tests, got, strict=True):
        own = np.array([c.evaluate(x, y) for x, y in sets])
        assert np.abs(acc - own).max() <= 1 / 37, (acc, own)  # one argmax flip at most
    assert all(c.model.training for c in cs)  # modes untouched


def test_models_that_differ_only_in_a_setting_do_not_share_a_stacked_forward():
    """Two trainers of one process (two runs) whose CNNs differ only in BatchNorm's momentum,
    which no state shape shows: each stacked step updates the statistics with its own."""
    bn = "features.0.1.running_mean"
    for momentum in (0.3, 0.9):
        torch.manual_seed(0)
        models = [build_model("cnn", (1, 8, 8), 4, bn_momentum=momentum) for _ in range(2)]
        own = build_model("cnn", (1, 8, 8), 4, bn_momentum=momentum)
        own.load_state_dict(models[0].state_dict())
        opts = [make_optimizer(m, LearnConfig()) for m in models]
        x, y = torch.randn(2, 5, 1, 8, 8), torch.randint(0, 4, (2, 5))
        FleetTrainer().train_stacked(models, opts, [[(x[k], y[k])] for k in range(2)])
        own.train()(x[0])
        close(models[0].state_dict()[bn], own.state_dict()[bn], momentum)
