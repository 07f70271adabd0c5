"""The online Client on its own: schedule, replay exclusion, merges, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.messages import GlobalModel
from edgefcl.learn.client import Client
from edgefcl.learn.merges import MERGES
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors


def make_client(method="bi", burn_in=2, jump=2, memory=20, device="cpu", mode="sync",
                in_flight=4):
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, hidden=16)
    return new_client("c0", model, LearnConfig(method=method, memory_size=memory, local_epochs=2,
                                               device=device),
                      FedConfig(burn_in=burn_in, jump=jump, mode=mode, in_flight=in_flight),
                      "vector", seed=0)


def batch(task, index, classes, n=5, seed=0):
    rng = np.random.default_rng(seed + 100 * task + index)
    y = rng.choice(classes, n).astype(np.int64)
    x = (rng.standard_normal((n, 6)) + y[:, None]).astype(np.float32)
    return Batch(x, y, task, index, False)


def test_updates_follow_burn_in_and_jump_and_restart_per_task():
    c = make_client(burn_in=3, jump=2)
    sent = [c.step(batch(0, i, [0, 1])) is not None for i in range(1, 8)]
    assert sent == [False, False, False, True, False, True, False]  # batch_in_task 4 and 6
    sent = [c.step(batch(1, i, [2, 3])) is not None for i in range(1, 5)]
    assert sent == [False, False, False, True]  # burn-in restarted with the task


def test_update_carries_counters_and_class_counts():
    c = make_client(burn_in=1, jump=1)
    u = c.step(batch(0, 1, [0, 1]))
    assert (u.client, u.seq, u.task, u.batch, u.num_samples) == ("c0", 1, 0, 1, 5)
    assert sum(u.class_counts.values()) == 5
    assert set(u.tensors) == set(get_tensors(c.model))


def test_replay_never_draws_the_current_task():
    c = make_client(method="er", memory=30)
    for i in range(1, 6):
        c.step(batch(0, i, [0, 1]))
    seen = []
    real_sample = c.memory.sample

    def spy(n, exclude_task=None):
        out = real_sample(n, exclude_task)
        seen.append((exclude_task, None if out is None else out[1].tolist()))
        return out

    c.memory.sample = spy
    c.step(batch(1, 1, [2, 3]))
    assert seen and all(ex == 1 for ex, _ in seen)
    assert all(set(ys) <= {0, 1} for _, ys in seen if ys is not None)


def test_fedavg_method_keeps_no_memory_and_bi_scores():
    plain = make_client(method="fedavg")
    plain.step(batch(0, 1, [0, 1]))
    assert plain.memory is None and plain.scored == 0
    bi = make_client(method="bi")
    bi.step(batch(0, 1, [0, 1]))
    assert bi.memory is not None and bi.scored == 0  # filling: no score decides anything
    small = make_client(method="bi", memory=2)
    small.step(batch(0, 1, [0, 1]))
    assert small.memory.size == 2 and small.scored > 0


def test_apply_global_replace_and_delta_merge():
    c = make_client(burn_in=2, jump=2)
    c.step(batch(0, 1, [0, 1]))
    u = c.step(batch(0, 2, [0, 1]))
    g = GlobalModel(1, {k: np.zeros_like(v) for k, v in u.tensors.items()}, ("c0",))
    c.apply_global(g)
    assert all(np.all(v == 0) for v in get_tensors(c.model).values()) and c.version == 1
    c.step(batch(0, 3, [0, 1]))
    u2 = c.step(batch(0, 4, [0, 1]))
    assert c.step(batch(0, 5, [0, 1])) is None  # progress made after sending u2
    now = get_tensors(c.model)
    g2 = GlobalModel(2, {k: np.ones_like(v) for k, v in u2.tensors.items()}, ("c0",))
    c.apply_global(g2, MERGES["delta"])
    merged = get_tensors(c.model)
    for k in merged:
        np.testing.assert_allclose(merged[k], 1 + now[k] - u2.tensors[k], atol=1e-6)


def test_a_global_holding_an_older_update_keeps_the_progress_since_that_one():
    """Async: u1 (seq 1) and u2 (seq 2) went out; a global that holds u1 is merged as
    theta_g + theta_now - theta_u1 even by the replace rule (u2 is on its way), and a later
    global holding u2 replaces, as u2 itself was moved by the same shift: theta_g2."""
    c = make_client(burn_in=2, jump=2, mode="async")
    c.step(batch(0, 1, [0, 1]))
    u1 = c.step(batch(0, 2, [0, 1]))
    c.step(batch(0, 3, [0, 1]))
    u2 = c.step(batch(0, 4, [0, 1]))
    c.step(batch(0, 5, [0, 1]))
    now = get_tensors(c.model)
    ones = {k: np.ones_like(v) for k, v in u1.tensors.items()}
    c.apply_global(GlobalModel(1, ones, ("c0",), counted={"c0": 1}))
    merged = get_tensors(c.model)
    for k in merged:
        np.testing.assert_allclose(merged[k], 1 + now[k] - u1.tensors[k], atol=1e-6)
    assert list(c.in_flight) == [2]
    for k in merged:  # u2 as from the merged model
        np.testing.assert_allclose(c.in_flight[2][k], u2.tensors[k] + 1 - u1.tensors[k],
                                   atol=1e-6)
    twos = {k: np.full_like(v, 2.0) for k, v in u1.tensors.items()}
    c.apply_global(GlobalModel(2, twos, ("c0",), counted={"c0": 2}))
    assert all(np.all(v == 2.0) for v in get_tensors(c.model).values())
    assert c.in_flight == {}


def test_the_newest_update_held_or_no_count_given_the_replace_rule_replaces():
    c = make_client(burn_in=2, jump=2, mode="async")
    c.step(batch(0, 1, [0, 1]))
    u1 = c.step(batch(0, 2, [0, 1]))
    c.step(batch(0, 3, [0, 1]))
    zeros = {k: np.zeros_like(v) for k, v in u1.tensors.items()}
    c.apply_global(GlobalModel(1, zeros, ("c0",)))  # lock-step, or no count
    assert all(np.all(v == 0) for v in get_tensors(c.model).values())
    c.step(batch(0, 4, [0, 1]))
    c.apply_global(GlobalModel(2, zeros, ("c0",), counted={"c0": 2}))
    assert all(np.all(v == 0) for v in get_tensors(c.model).values())
    assert make_client().in_flight == {}  # lock-step keeps no sent states


def test_with_in_flight_off_a_global_holding_an_older_update_replaces():
    c = make_client(burn_in=2, jump=2, mode="async", in_flight=0)
    c.step(batch(0, 1, [0, 1]))
    u1 = c.step(batch(0, 2, [0, 1]))
    c.step(batch(0, 3, [0, 1]))
    c.step(batch(0, 4, [0, 1]))  # u2 goes out
    assert c.in_flight == {}
    zeros = {k: np.zeros_like(v) for k, v in u1.tensors.items()}
    c.apply_global(GlobalModel(1, zeros, ("c0",), counted={"c0": 1}))
    assert all(np.all(v == 0) for v in get_tensors(c.model).values())


def test_the_delta_rule_keeps_the_progress_since_the_counted_update_too():
    c = make_client(burn_in=2, jump=2, mode="async")
    c.step(batch(0, 1, [0, 1]))
    u1 = c.step(batch(0, 2, [0, 1]))
    c.step(batch(0, 3, [0, 1]))
    c.step(batch(0, 4, [0, 1]))  # u2 goes out
    now = get_tensors(c.model)
    ones = {k: np.ones_like(v) for k, v in u1.tensors.items()}
    c.apply_global(GlobalModel(1, ones, ("c0",), counted={"c0": 1}), MERGES["delta"])
    for k, v in get_tensors(c.model).items():
        np.testing.assert_allclose(v, 1 + now[k] - u1.tensors[k], atol=1e-6)


def test_scoring_snapshot_changes_only_at_a_merge():
    c = make_client(burn_in=1, jump=1)
    c.step(batch(0, 1, [0, 1]))
    assert c.score_model is None  # no merge yet: the live model scores
    v = c.score_version
    c.apply_global(GlobalModel(1, get_tensors(c.model), ("c0",)))
    assert c.score_model is not None and c.score_version == v + 1
    c.step(batch(0, 2, [0, 1]))
    assert c.score_version == v + 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_client_trains_on_cuda():
    c = make_client(device="cuda", burn_in=1, jump=1)
    u = c.step(batch(0, 1, [0, 1]))
    assert next(c.model.parameters()).is_cuda and c.memory.x.is_cuda
    assert u.tensors and all(t.dtype == np.float32 for t in u.tensors.values())


def test_delta_merge_never_moves_batchnorm_statistics_below_zero():
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 4)
    c = new_client("c0", model, LearnConfig(method="er", memory_size=10, local_epochs=1),
                   FedConfig(burn_in=1, jump=1), "image", seed=0)
    rng = np.random.default_rng(0)

    def img_batch(i):
        y = rng.integers(0, 4, 5)
        return Batch(rng.random((5, 1, 8, 8), dtype=np.float32), y.astype(np.int64), 0, i,
                     False)

    u = c.step(img_batch(1))
    c.step(img_batch(2))
    # a global whose running variances are far below what the client sent
    g = {k: (v * 1e-3 if "running_var" in k else v) for k, v in u.tensors.items()}
    c.sent = u.tensors
    c.apply_global(GlobalModel(1, g, ("c0",)), MERGES["delta"])
    state = get_tensors(c.model)
    for k in state:
        if "running_var" in k:
            np.testing.assert_array_equal(state[k], g[k])
            assert (state[k] >= 0).all()


def _image_client(overlap: bool, selection: str) -> Client:
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 4)
    learn = LearnConfig(method="bi", memory_size=8, local_epochs=2, score_overlap=overlap,
                        selection=selection, perturbations=4)
    return new_client("c0", model, learn, FedConfig(burn_in=1, jump=2), "image", seed=0)


@pytest.mark.parametrize("selection", ["step", "bottom"])
def test_scoring_while_training_changes_nothing(selection):
    """Scores computed on a second thread during training (frozen snapshot) give the same
    model, memory and scores as scoring after training."""
    clients = [_image_client(overlap, selection) for overlap in (False, True)]
    rng = np.random.default_rng(0)
    for i in range(12):
        task = i // 6
        y = rng.choice([2 * task, 2 * task + 1], 5).astype(np.int64)
        x = rng.random((5, 1, 8, 8)).astype(np.float32)
        for c in clients:
            if c.step(Batch(x, y, task, i, False)) is not None:
                c.apply_global(GlobalModel(c.version + 1, get_tensors(c.model), ("c0",)))
    off, on = clients
    assert on.scored_ahead > 0 and off.scored_ahead == 0
    for k, v in get_tensors(off.model).items():
        np.testing.assert_array_equal(v, get_tensors(on.model)[k])
    assert torch.equal(off.memory.x, on.memory.x) and torch.equal(off.memory.score, on.memory.score)
    assert off.scored == on.scored > 0


def test_the_learner_learns_alone_and_the_wrapper_only_adds_the_schedule():
    """Client.step is StreamLearner.learn_one plus the schedule and encoding: same model, same
    memory, and the learner holds no federation state."""
    fed_client, alone = make_client(burn_in=0, jump=1), make_client(burn_in=0, jump=1)
    learner = alone.learner
    for i in range(1, 6):
        b = batch(0, i, [0, 1, 2])
        assert fed_client.step(b) is not None
        assert learner.learn_one(b) is None
    for k, v in get_tensors(fed_client.model).items():
        np.testing.assert_array_equal(v, get_tensors(learner.model)[k])
    assert torch.equal(fed_client.memory.x, learner.memory.x)
    assert (learner.batch_in_task, learner.batches, fed_client.seq, alone.seq) == (5, 5, 5, 0)
    assert not any(hasattr(learner, k) for k in ("encoder", "fed", "seq", "version", "base"))
    assert learner.clock.now() <= learner.clock.now()


def test_a_held_update_survives_a_reboot_and_stays_in_its_task():
    c = make_client(burn_in=2, jump=2)
    c.pace = lambda: False  # backpressure holds every due update
    assert [c.step(batch(0, i, [0, 1])) for i in (1, 2, 3)] == [None] * 3
    due = (0, 2, 10, dict(c.held[3]))
    assert c.held == due and sum(due[3].values()) == 10  # what batch 2 was due with
    rebooted = make_client(burn_in=2, jump=2)
    rebooted.load_state_dict(c.state_dict())
    assert rebooted.held == due
    u = rebooted.held_update()
    assert (u.task, u.batch, u.num_samples, u.class_counts) == due and u.seq == c.seq
    assert rebooted.held_update() is None  # once
    # the stream goes on into the next task before it ends: that task's burn-in has not
    # passed, so the update held in the task before is not sent with the new task's training
    c.step(batch(1, 1, [2, 3]))
    assert c.held_update() is None and c.held is None


def test_state_dict_lists_its_parts_explicitly():
    c = make_client()
    for i in range(1, 4):
        c.step(batch(0, i, [0, 1]))
    state = c.state_dict()
    assert set(state) == {"format", "fingerprint", "model", "optimizer", "generator", "memory",
                          "perturber", "score_model", "counters", "class_counts", "timings",
                          "sample_shape", "monitor", "onnx", "prototypes", "base", "sent",
                          "downlink", "encoder", "hooks", "held"}
    assert set(state["counters"]) == {"score_version", "task", "batch_in_task",
                                      "samples_in_task", "scored", "batches", "version", "seq",
                                      "sent_base"}
    fresh = make_client()
    fresh.load_state_dict(state)
    assert ((fresh.batch_in_task, fresh.seq, fresh.memory.size)
            == (c.batch_in_task, c.seq, c.memory.size))
