"""ONNX export and on-device inference: parity with torch, dynamic batch, the predict CLI
without torch, run-directory export, client-side export and onnxruntime scoring."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.config import (
    ConfigError,
    FedConfig,
    LearnConfig,
    RunConfig,
    apply,
    scores_with_onnxruntime,
)
from edgefcl.data.types import Batch, DataError
from edgefcl.federation.messages import GlobalModel
from edgefcl.learn.client import Client
from edgefcl.learn.export import EXAMPLE_BATCH, export_onnx, export_run, max_logit_diff
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors
from edgefcl.learn.scoring.perturb import tta_logits
from edgefcl.learn.scoring.scores import uncertainty
from edgefcl.learn.scoring.snapshot import SHARED_TEMPLATES, OnnxTemplate
from edgefcl.ondevice import OnnxModel, predict_file

PARITY = 1e-4


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32)[:, None], d.target.astype(np.int64)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_shared_templates():
    """Each test starts without the templates earlier tests of this process exported."""
    SHARED_TEMPLATES.clear()
    yield
    SHARED_TEMPLATES.clear()


def _trained(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, steps: int = 3):
    """A few SGD steps in train mode: weights and BatchNorm statistics leave their init."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    return model


def test_export_parity_mlp_and_cnn_on_digits(digits):
    x, y = digits
    train, test = slice(0, 256), slice(1500, 1797)
    for name in ("mlp", "cnn"):
        torch.manual_seed(0)
        model = _trained(build_model(name, (1, 8, 8), 10, hidden=64), x[train], y[train])
        model.train()  # export must switch to eval mode by itself and restore the mode
        data = export_onnx(model, (1, 8, 8))
        assert model.training
        diff = max_logit_diff(model, data, x[test])
        assert diff < PARITY, (name, diff)
        # predictions agree on the test data too
        with torch.no_grad():
            ref = model.eval()(torch.from_numpy(x[test])).argmax(1).numpy()
        assert (OnnxModel(data).predict(x[test]) == ref).all()


def test_export_parity_resnet18():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10)
    for m in model.modules():  # BatchNorm statistics away from their init (as after training)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.rand(8, 3, 32, 32).numpy()
    assert max_logit_diff(model, export_onnx(model, (3, 32, 32)), x) < PARITY


def test_dynamic_batch_and_single_file(tmp_path):
    torch.manual_seed(1)
    model = build_model("cnn", (1, 8, 8), 10).eval()
    path = tmp_path / "m.onnx"
    data = export_onnx(model, (1, 8, 8), path)
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no external-data sidecar
    m = OnnxModel(path)
    assert m.fixed_batch is None and m.sample_shape == (1, 8, 8)
    for n in (1, 7):  # neither is the example batch of the export
        assert n != EXAMPLE_BATCH
        x = torch.rand(n, 1, 8, 8)
        with torch.no_grad():
            ref = model(x).numpy()
        z = m.logits(x.numpy())
        assert z.shape == (n, 10)
        np.testing.assert_allclose(z, ref, atol=PARITY)
    # chunked prediction of a large array equals one call
    x = torch.rand(50, 1, 8, 8).numpy()
    np.testing.assert_allclose(m.logits(x, batch_size=7), m.logits(x), atol=1e-6)


@pytest.mark.slow  # the dynamo exporter needs ~3 s for even a tiny model
def test_dynamo_exporter_matches():
    torch.manual_seed(2)
    model = build_model("mlp", (12,), 3, hidden=8)
    data = export_onnx(model, (12,), exporter="dynamo")
    x = torch.rand(5, 12).numpy()
    assert max_logit_diff(model, data, x) < PARITY
    assert OnnxModel(data).logits(x[:1]).shape == (1, 3)


def test_bad_inputs_are_rejected(tmp_path):
    model = build_model("mlp", (4,), 2, hidden=4)
    m = OnnxModel(export_onnx(model, (4,)))
    with pytest.raises(DataError, match=r"shape \(batch, 4\)"):
        m.logits(np.zeros((3, 5), np.float32))
    with pytest.raises(DataError, match="NaN"):
        m.logits(np.full((2, 4), np.nan, np.float32))
    with pytest.raises(DataError, match="not found"):
        OnnxModel(tmp_path / "missing.onnx")
    with pytest.raises(DataError, match="cannot load"):
        OnnxModel(b"not an onnx model")
    with pytest.raises(ConfigError, match="exporter"):
        export_onnx(model, (4,), exporter="tf")


def test_predict_cli_does_not_import_torch(tmp_path, digits):
    x, y = digits
    torch.manual_seed(3)
    model = build_model("cnn", (1, 8, 8), 10).eval()
    export_onnx(model, (1, 8, 8), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", x[:40])
    np.save(tmp_path / "y.npy", y[:40])
    code = (
        "import sys\n"
        "from edgefcl.cli import main\n"
        f"rc = main(['predict', '--model', {str(tmp_path / 'm.onnx')!r}, '--input', "
        f"{str(tmp_path / 'x.npy')!r}, '--output', {str(tmp_path / 'p.npy')!r}, '--labels', "
        f"{str(tmp_path / 'y.npy')!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'onnxruntime' in sys.modules\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "TORCH False" in out.stdout
    assert "40 predictions" in out.stdout and "accuracy" in out.stdout
    with torch.no_grad():
        ref = model(torch.from_numpy(x[:40])).argmax(1).numpy()
    pred = np.load(tmp_path / "p.npy")
    assert pred.dtype == np.int64 and (pred == ref).all()
    summary = predict_file(tmp_path / "m.onnx", tmp_path / "x.npy", labels=tmp_path / "y.npy")
    assert summary["samples"] == 40
    assert summary["accuracy"] == pytest.approx(float((ref == y[:40]).mean()))
    assert sum(summary["classes"].values()) == 40


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A small simulated run written like `edgefcl simulate --out DIR`."""
    from edgefcl.outcomes.report import write_run
    from edgefcl.sim.runs import simulate

    cfg = apply(RunConfig(), {"data": {"tasks": 2}, "fed": {"clients": 2},
                              "learn": {"method": "er", "model": "mlp", "hidden": 32,
                                        "memory_size": 20, "local_epochs": 1},
                              "quiet": True})
    out = tmp_path_factory.mktemp("run")
    write_run(simulate(cfg), out)
    return out


def test_simulate_saves_global_and_export_run(run_dir, digits):
    x, _ = digits
    results = json.loads((run_dir / "results.json").read_text())
    assert results["model_spec"] == {"model": "mlp", "sample_shape": [1, 8, 8],
                                     "n_classes": 10, "hidden": 32}
    r = export_run(run_dir)
    assert Path(r["path"]) == run_dir / "model.onnx" and r["max_abs_diff"] < PARITY
    # the exported model is the run's final global: same sha256 as results.json reports
    from edgefcl.learn.export import load_run_model
    from edgefcl.learn.params import tensors_sha256

    model, _ = load_run_model(run_dir)
    assert tensors_sha256(get_tensors(model)) == results["global_sha256"]
    assert max_logit_diff(model, (run_dir / "model.onnx").read_bytes(), x[:100]) < PARITY


def test_export_run_errors(tmp_path, run_dir):
    with pytest.raises(DataError, match="no results.json"):
        export_run(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(
        {"summary": {}, "runs": [{"method": "bi", "seed": 0}]}))
    with pytest.raises(DataError, match="several runs.*bi/seed0"):
        export_run(tmp_path)
    (tmp_path / "results.json").write_text((run_dir / "results.json").read_text())
    with pytest.raises(DataError, match="no saved global model"):
        export_run(tmp_path)


def _client(learn: LearnConfig, seed: int = 0, kind: str = "vector") -> Client:
    torch.manual_seed(seed)
    model = build_model("mlp", (6,), 4, hidden=16)
    return new_client("c007", model, learn, FedConfig(burn_in=0, jump=1), kind, seed=seed)


def _batches(n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [Batch(rng.random((8, 6), dtype=np.float32), rng.integers(0, 4, 8), 0, i + 1, False)
            for i in range(n)]


def test_client_exports_live_model_after_each_global(tmp_path):
    learn = LearnConfig(method="er", memory_size=10, export_onnx=str(tmp_path / "{cid}.onnx"))
    c = _client(learn)
    for b in _batches(2):
        c.step(b)
    assert not (tmp_path / "c007.onnx").exists()  # only after a global
    g = GlobalModel(1, {k: v + 0.01 for k, v in get_tensors(c.model).items()}, ("c007",))
    c.apply_global(g)
    path = tmp_path / "c007.onnx"
    assert path.is_file() and c.onnx is not None and c.onnx.exports == 1
    x = np.random.default_rng(1).random((5, 6), dtype=np.float32)
    assert max_logit_diff(c.model, path.read_bytes(), x) < PARITY
    c.apply_global(GlobalModel(2, g.tensors, ("c007",)))
    assert c.onnx.exports == 2


def test_onnxruntime_scoring_matches_torch():
    learn = LearnConfig(method="bi", memory_size=12, score_backend="onnxruntime")
    c = _client(learn, seed=5)
    ref = _client(dataclasses.replace(learn, score_backend="torch"), seed=5)
    for b in _batches(3):
        c.step(b)
        ref.step(b)
    g = GlobalModel(1, get_tensors(c.model), ("c007",))
    c.apply_global(g)
    ref.apply_global(g)
    x = torch.rand(9, 6)
    a, b = c.learner._score(x), ref.learner._score(x)  # same perturber seeds: same views
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    # the onnxruntime path ran (an export of the snapshot) and matches the torch logits
    assert c.onnx is not None and c.onnx._snapshot.version == c.score_version
    z_ort = c.onnx.tta_logits(c, x)
    z_torch = tta_logits(ref.score_model, x, ref.perturber)
    np.testing.assert_allclose(z_ort.numpy(), z_torch.numpy(), atol=PARITY)


def test_auto_backend_scores_with_onnxruntime_on_the_cpu_with_tta_only():
    auto = LearnConfig()
    assert auto.score_backend == "auto" and scores_with_onnxruntime(auto)
    assert not scores_with_onnxruntime(dataclasses.replace(auto, device="cuda"))
    assert not scores_with_onnxruntime(dataclasses.replace(auto, score_source="posterior"))
    assert not scores_with_onnxruntime(dataclasses.replace(auto, score_backend="torch"))
    assert scores_with_onnxruntime(dataclasses.replace(auto, score_backend="onnxruntime"))
    apply(RunConfig(), {"learn": {"device": "cuda"}})  # auto: valid on CUDA, scored by torch


def test_score_backend_validation():
    with pytest.raises(ConfigError, match="score_backend must be"):
        apply(RunConfig(), {"learn": {"score_backend": "tvm"}})
    with pytest.raises(ConfigError, match="device cpu"):
        apply(RunConfig(), {"learn": {"score_backend": "onnxruntime", "device": "cuda"}})


def test_template_takes_another_models_weights():
    # one export of the architecture computes another model's logits, BatchNorm statistics
    # included; the attack: a fresh BatchNorm's weight and running variance are both ones,
    # which an exporter may store as one shared initializer, and onnxruntime folds BatchNorm
    # into the convolution when it loads the graph
    torch.manual_seed(0)
    first, second = build_model("cnn", (1, 8, 8), 5), build_model("cnn", (1, 8, 8), 5)
    with torch.no_grad():
        for bn in (m for m in second.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    template = OnnxTemplate(first, (1, 8, 8))
    assert template.complete
    x = torch.rand(7, 1, 8, 8)
    with torch.no_grad():
        want, old = second.eval()(x).numpy(), first.eval()(x).numpy()
    got = OnnxModel(template.with_weights(second.state_dict())).logits(x.numpy())
    np.testing.assert_allclose(got, want, atol=PARITY)
    assert np.abs(got - old).max() > 100 * PARITY
    got = OnnxModel(template.with_weights(first.state_dict())).logits(x.numpy())
    np.testing.assert_allclose(got, old, atol=PARITY)


@pytest.mark.parametrize("arch,shape", [("cnn", (1, 8, 8)), ("mlp", (12,))])
def test_a_refill_writes_the_graph_protobuf_would(arch, shape):
    # the refill overwrites byte ranges of one serialized graph; it must be the very graph
    # that setting the initializers and serializing gives, for every weight of the model
    torch.manual_seed(1)
    first, second = build_model(arch, shape, 4), build_model(arch, shape, 4)
    template = OnnxTemplate(first, shape)
    assert template._spans is not None
    fast = template.with_weights(second.state_dict())
    spans, template._spans = template._spans, None
    assert fast == template.with_weights(second.state_dict())
    assert fast != template.with_weights(first.state_dict())
    template._spans = spans
    bigger = build_model(arch, shape, 5)  # a weight of another size must not be written
    with pytest.raises(DataError, match="bytes"):
        template.with_weights(bigger.state_dict())


def test_onnxruntime_scoring_follows_each_snapshot_from_one_export():
    learn = LearnConfig(method="bi", memory_size=12, score_backend="onnxruntime")
    torch.manual_seed(3)
    model = build_model("cnn", (1, 8, 8), 4)
    c = new_client("c007", model, learn, FedConfig(burn_in=0, jump=1), "image", seed=3)
    rng = np.random.default_rng(3)
    x = torch.rand(6, 1, 8, 8)
    for version in range(1, 4):
        for i in range(2):  # training moves the weights and the BatchNorm statistics
            c.step(Batch(rng.random((8, 1, 8, 8), dtype=np.float32), rng.integers(0, 4, 8),
                         0, i + 1, False))
        c.apply_global(GlobalModel(version, get_tensors(c.model), ("c007",)))
        state = c.perturber.state_dict()
        z_ort = c.onnx.tta_logits(c, x)
        c.perturber.load_state_dict(state)  # the same views for torch
        z_torch = tta_logits(c.score_model, x, c.perturber)
        np.testing.assert_allclose(z_ort.numpy(), z_torch.numpy(), atol=PARITY)
    assert c.onnx.scoring_exports == 1  # the architecture once, then only weight swaps
    assert c.learner.scored_ahead > 0  # and it scored on the second thread


def _scored_once(c: Client, seed: int) -> None:
    """Two batches and a global: the client's scoring snapshot is set."""
    rng = np.random.default_rng(seed)
    for i in range(2):
        c.step(Batch(rng.random((8, 6), dtype=np.float32), rng.integers(0, 4, 8), 0, i + 1,
                     False))
    c.apply_global(GlobalModel(1, get_tensors(c.model), (c.cid,)))


def _ort_matches_torch(c: Client) -> None:
    x = torch.rand(5, 6)
    state = c.perturber.state_dict()
    z_ort = c.onnx.tta_logits(c, x)
    c.perturber.load_state_dict(state)
    np.testing.assert_allclose(z_ort.numpy(), tta_logits(c.score_model, x, c.perturber).numpy(),
                               atol=PARITY)


def test_clients_of_one_process_share_one_export():
    learn = LearnConfig(method="bi", memory_size=12, score_backend="onnxruntime")
    clients = [_client(learn, seed=s) for s in (1, 2, 3)]
    for s, c in enumerate(clients):
        _scored_once(c, s)
        _ort_matches_torch(c)  # each its own weights through the one graph
    assert [c.onnx.scoring_exports for c in clients] == [1, 0, 0]


class _Signed(torch.nn.Module):
    """A layer whose sign is not in its repr or its state: two of them look alike."""

    def __init__(self, sign: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)
        self.sign = sign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sign * self.fc(x)


def test_a_shared_template_of_another_model_is_not_used():
    # the attack: a model with the same class, repr and state shapes as the one a shared
    # template was exported from, but another forward
    learn = LearnConfig(method="bi", memory_size=12, score_backend="onnxruntime")
    fed = FedConfig(burn_in=0, jump=1)
    plus, minus = (new_client(f"c{i}", _Signed(sign), learn, fed, "vector", seed=i)
                   for i, sign in enumerate((1.0, -1.0)))
    _scored_once(plus, 0)
    _ort_matches_torch(plus)
    _scored_once(minus, 1)
    _ort_matches_torch(minus)  # its own export, not the template's graph
    assert (plus.onnx.scoring_exports, minus.onnx.scoring_exports) == (1, 1)


def test_a_template_that_bakes_in_tensors_outside_the_state_is_not_refilled():
    # a prototype library's rows are read by the forward but not in the state_dict: a refill
    # would keep the rows the export saw, so the client exports each snapshot whole instead
    from edgefcl.learn.proto_net import proto_model

    model = proto_model(build_model("mlp", (12,), 1, hidden=8))
    model.library.ensure(["a", "b", "c"])
    assert not OnnxTemplate(model, (12,)).complete
    assert OnnxTemplate(build_model("mlp", (12,), 3, hidden=8), (12,)).complete


@pytest.mark.parametrize("backend", ["auto", "onnxruntime"])
def test_a_model_onnxruntime_cannot_run_falls_back_to_torch_under_auto(monkeypatch, backend):
    import edgefcl.learn.scoring.snapshot as snapshot

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr(snapshot, "OnnxTemplate", refuse)
    c = _client(LearnConfig(method="bi", memory_size=12, score_backend=backend), seed=5)
    for b in _batches(3):
        c.step(b)
    c.apply_global(GlobalModel(1, get_tensors(c.model), ("c007",)))
    x = torch.rand(9, 6)
    if backend == "onnxruntime":
        with pytest.raises(ConfigError, match="cannot run this model.*--score-backend torch"):
            c.learner._score(x)
        return
    state = c.perturber.state_dict()
    scores = c.learner._score(x)  # torch, and for good: no second attempt
    assert not c.onnx.ort_scoring
    c.perturber.load_state_dict(state)
    ref = uncertainty(c.learner.score_method, tta_logits(c.score_model, x, c.perturber))
    assert torch.equal(scores, ref)
