"""Task-free drift detection, segment-driven task boundaries and prequential accuracy."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.cli import build_parser, config_from_args
from edgefcl.config import ConfigError, FedConfig, LearnConfig, RunConfig, apply
from edgefcl.data.types import Batch
from edgefcl.learn.client import Client
from edgefcl.learn.drift import (
    DriftDetector,
    Prequential,
    boundaries,
    drift_report,
    match_boundaries,
    stream_lines,
    stream_report,
)
from edgefcl.learn.models import build_model

B = 10  # samples per batch


def _loss_batch(losses: np.ndarray, task: int, index: int) -> tuple[Batch, torch.Tensor]:
    """A 2-class batch whose per-sample cross-entropy is exactly `losses`: label 0, logits
    (a, 0) with log(1 + exp(-a)) = loss."""
    a = -np.log(np.expm1(losses))
    logits = torch.from_numpy(np.stack([a, np.zeros_like(a)], 1).astype(np.float32))
    y = np.zeros(len(losses), np.int64)
    return Batch(np.zeros((len(losses), 3), np.float32), y, task, index, False), logits


pytestmark = pytest.mark.usefixtures("one_thread")


def test_loss_signal_segments_abrupt_shifts():
    rng = np.random.default_rng(0)
    det = DriftDetector("loss")
    seg_len, n_seg = 12, 4
    for k in range(n_seg):
        for t in range(seg_len):
            # a new task: high loss that falls as the model learns it, plus noise
            mean = 0.2 + 3.0 * np.exp(-t / 1.5)
            losses = np.clip(mean + 0.1 * rng.standard_normal(B), 0.01, None)
            batch, logits = _loss_batch(losses, 10 + k, t + 1)
            det.observe(batch, torch.from_numpy(batch.x), torch.from_numpy(batch.y), logits)
    true = boundaries(det.true_tasks)
    assert true == [12, 24, 36]
    found = boundaries(det.segments)
    assert len(found) == len(true)  # no false alarms
    assert all(0 <= d - b <= 1 for b, d in zip(true, found, strict=True))
    assert det.segments[0] == 0 and det.segment == 3  # ids count detections, not true tasks


def test_feature_signal_detects_input_shift():
    rng = np.random.default_rng(1)
    det = DriftDetector("features")
    means = [0.0, 4.0, -4.0]
    for k, mu in enumerate(means):
        for t in range(15):
            x = (mu + rng.standard_normal((B, 5))).astype(np.float32)
            batch = Batch(x, np.zeros(B, np.int64), k, t + 1, False)
            det.observe(batch, torch.from_numpy(x), torch.from_numpy(batch.y), None)
    pairs = match_boundaries(boundaries(det.true_tasks), boundaries(det.segments), 2)
    assert [b for b, _ in pairs] == [15, 30]
    assert len(boundaries(det.segments)) == 2


def test_drift_options_are_validated():
    with pytest.raises(ConfigError, match="drift_signal"):
        DriftDetector("entropy")
    with pytest.raises(ConfigError, match="drift_signal must be"):
        apply(RunConfig(), {"learn": {"drift_signal": "entropy"}})
    with pytest.raises(ConfigError, match="drift_delta"):
        apply(RunConfig(), {"learn": {"drift_delta": 1.5}})
    assert DriftDetector("loss").delta == 0.002 and DriftDetector("features").delta == 0.05
    args = build_parser().parse_args(["simulate", "--task-free", "--drift-signal", "features",
                                      "--no-prequential"])
    cfg = config_from_args(args)
    assert cfg.learn.task_free and not cfg.learn.prequential
    assert cfg.learn.drift_signal == "features"
    assert config_from_args(build_parser().parse_args(["simulate"])).learn.prequential


def test_boundary_matching_by_hand():
    assert boundaries([3, 3, 5, 5, 5, 7]) == [2, 5]
    assert boundaries([1]) == [] and boundaries([]) == []
    true, det = [10, 20, 30], [10, 12, 25, 31]
    # 10 -> 10 (delay 0); 20: nothing in [20, 24]; 30 -> 31 (delay 1); 12 and 25 are false
    assert match_boundaries(true, det, 4) == [(10, 10), (30, 31)]
    # a detection past the next true boundary is not credited to the earlier one
    assert match_boundaries([10, 12], [13], 4) == [(12, 13)]


def test_drift_report_by_hand():
    a, b = DriftDetector("loss"), DriftDetector("loss")
    a.true_tasks, a.segments = [0] * 10 + [1] * 10 + [2] * 10, [0] * 11 + [1] * 4 + [2] * 15
    b.true_tasks, b.segments = [0] * 5 + [1] * 5, [0] * 10
    r = drift_report({"c0": a, "c1": b}, tolerance=3)
    assert r["per_client"]["c0"]["true"] == [10, 20]
    assert r["per_client"]["c0"]["detected"] == [11, 15]
    assert r["per_client"]["c0"]["matched"] == [[10, 11]]
    assert r["per_client"]["c1"]["precision"] is None and r["per_client"]["c1"]["recall"] == 0
    assert (r["true_boundaries"], r["detected_boundaries"], r["matched"]) == (3, 2, 1)
    assert r["precision"] == 0.5 and r["recall"] == pytest.approx(1 / 3)
    assert r["mean_delay"] == 1.0


def test_prequential_counts_match_hand_count():
    p = Prequential()
    p.update(np.array([0, 1, 2, 2, 1]), np.array([0, 2, 2, 2, 1]))  # 4 of 5 right
    p.update(np.array([3, 3, 0]), np.array([0, 3, 1]))  # 1 of 3 right
    assert p.samples == 8
    assert p.accuracy == pytest.approx(5 / 8)
    assert p.correct == 5


def test_prequential_counts_tensors_and_checkpoints_plain_counts():
    p = Prequential()
    p.update(torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 2, 2, 2, 1]))  # 4 of 5 right
    p.update(torch.tensor([3, 3, 0]), torch.tensor([0, 3, 1]))  # 1 of 3 right
    state = p.__getstate__()
    assert state == {"correct": 5, "samples": 8} and type(state["correct"]) is int
    q = pickle.loads(pickle.dumps(p))
    assert (q.correct, q.samples, q.accuracy) == (5, 8, 5 / 8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prequential_counting_never_waits_for_the_device():
    p = Prequential()
    y = torch.tensor([0, 1, 2, 2, 1], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            p.update(y, y.flip(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (p.correct, p.samples) == (9, 15)


def test_prequential_restores_the_counts_of_a_river_metric():
    """A checkpoint written when the counts lived in a river `metrics.Accuracy`."""
    from river import metrics

    old = metrics.Accuracy()
    for t, y in ((0, 0), (1, 2), (2, 2), (2, 2), (1, 1)):
        old.update(t, y)
    p = Prequential.__new__(Prequential)
    p.__setstate__({"metric": old})
    assert (p.correct, p.samples, p.accuracy) == (4, 5, 0.8)


# -- the client --------------------------------------------------------------------------
def _class_incremental(n_per_task: int, seed: int = 0) -> list[Batch]:
    """Two tasks of two Gaussian classes each in 6-d (task 1: classes 2 and 3, unseen during
    task 0). True task ids are 7 and 9 so they cannot be confused with segment ids."""
    rng = np.random.default_rng(seed)
    centers = 3.0 * np.eye(4, 6)
    out = []
    for task, classes in ((7, (0, 1)), (9, (2, 3))):
        for i in range(n_per_task):
            y = rng.choice(classes, B)
            x = (centers[y] + 0.3 * rng.standard_normal((B, 6))).astype(np.float32)
            out.append(Batch(x, y.astype(np.int64), task, i + 1, i == n_per_task - 1))
    return out


def _client(learn: LearnConfig, burn_in: int = 3) -> Client:
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, hidden=32)
    return new_client("c0", model, learn, FedConfig(burn_in=burn_in, jump=1), "vector", seed=0)


def test_task_free_segment_drives_burn_in_and_replay():
    learn = LearnConfig(method="er", memory_size=40, task_free=True, local_epochs=2, lr=0.02)
    c = _client(learn)
    stream = _class_incremental(12)
    sent = []
    for b in stream:
        sent.append(c.step(b))
        assert c.task == c.monitor.drift.segment  # the segment, never the true task id
    det = c.monitor.drift
    assert boundaries(det.true_tasks) == [12]
    found = boundaries(det.segments)
    assert len(found) == 1 and 12 <= found[0] <= 13
    d = found[0]
    # burn-in restarted at the detected boundary: no update for the first burn_in - 1
    # batches of the segment, then updates tagged with the segment id
    assert all(u is None for u in sent[d:d + 2])
    assert sent[d + 2] is not None and sent[d + 2].task == 1 and sent[d + 2].batch == 3
    assert sent[d - 1] is not None and sent[d - 1].task == 0
    # the memory files samples under segment ids, so replay excludes the current segment
    assert set(c.memory.task[: c.memory.size].tolist()) == {0, 1}


def test_client_prequential_equals_hand_count_before_training():
    learn = LearnConfig(method="er", memory_size=20, local_epochs=1)
    c = _client(learn, burn_in=100)
    correct = total = 0
    for b in _class_incremental(4, seed=3):
        c.model.eval()
        with torch.no_grad():
            pred = c.model(torch.from_numpy(b.x)).argmax(1).numpy()
        correct += int((pred == b.y).sum())
        total += len(b.y)
        c.step(b)
    p = c.monitor.prequential
    assert p.samples == total == 80
    assert p.accuracy == pytest.approx(correct / total)
    assert c.monitor.drift is None and c.task == 9  # not task-free: the true task ids
    r = stream_report([c])
    assert r["prequential_per_client"] == {"c0": pytest.approx(100 * correct / total)}
    assert "drift" not in r
    assert "prequential" in stream_lines(r)[0]


def test_prequential_off_and_no_monitor():
    c = _client(LearnConfig(method="er", memory_size=10, prequential=False))
    assert c.monitor is None
    c.step(_class_incremental(1)[0])
    assert stream_report([c]) == {}
