"""The learning side's head registry (`learn/model_heads.py`): one `ModelHead` per federation
head, and the hooks that build, train and read each head's model."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from edgefcl.config import LearnConfig, RunConfig
from edgefcl.federation.heads import HEADS
from edgefcl.learn.model_heads import MODEL_HEADS, head_for, head_of, library_model_head
from edgefcl.learn.models import build_model
from edgefcl.learn.proto_net import ProtoNet
from edgefcl.learn.proto_train import PrototypeHead


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", (6,), 3, 8)


def test_every_federation_head_has_a_model_head() -> None:
    assert set(MODEL_HEADS) == set(HEADS)
    assert all(MODEL_HEADS[name].name == name for name in HEADS)
    assert HEADS[library_model_head().name].library


def test_fixed_head_leaves_the_model_alone() -> None:
    fixed = next(MODEL_HEADS[n] for n, h in HEADS.items() if not h.library)
    model = _model()
    assert fixed.wrap(model) is model
    assert not fixed.owns(model) and head_of(model) is fixed
    assert fixed.trainer(model, LearnConfig(), torch.device("cpu"), None) is None
    assert fixed.empty_table(model, False) is None
    assert fixed.labels(model) is None


def test_prototype_head_wraps_trains_and_round_trips_rows() -> None:
    head = library_model_head()
    model = head.wrap(_model())
    assert isinstance(model, ProtoNet) and head.owns(model) and head_of(model) is head
    table = head.empty_table(model, True)
    assert table is not None and table.width == model.dim + 1 and table.sigmas is not None
    assert head.labels(model) == []
    trainer = head.trainer(model, LearnConfig(), torch.device("cpu"), None)
    assert isinstance(trainer, PrototypeHead) and trainer.model is model
    rows = np.arange(2 * (model.dim + 1), dtype=np.float32).reshape(2, -1)
    head.load_rows(model, ["cat", "dog"], rows)
    assert head.labels(model) == ["cat", "dog"]
    np.testing.assert_array_equal(model.library.rows.numpy(), rows)


def test_a_config_picks_its_head() -> None:
    for name in HEADS:
        cfg = RunConfig()
        cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, head=name))
        assert head_for(cfg) is MODEL_HEADS[name]
