"""Model construction, auto-selection, forward shapes and parameter counts."""

from __future__ import annotations

import pytest
import torch

from edgefcl.config import ConfigError
from edgefcl.learn.models import (
    BN_MOMENTUM,
    MLP,
    SlimResNet18,
    SmallCNN,
    build_model,
    count_parameters,
    penultimate,
    resolve_model_name,
)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((384,), MLP),
        ((40,), MLP),
        ((1, 8, 8), SmallCNN),
        ((1, 28, 28), SmallCNN),
        ((3, 31, 40), SmallCNN),
        ((3, 32, 32), SlimResNet18),
        ((3, 64, 64), SlimResNet18),
    ],
)
def test_auto_selection(shape: tuple[int, ...], expected: type) -> None:
    assert isinstance(build_model("auto", shape, 10), expected)


def test_resolve_model_name() -> None:
    assert resolve_model_name("auto", (3, 32, 32)) == "resnet18"
    assert resolve_model_name("auto", (1, 28, 28)) == "cnn"
    assert resolve_model_name("auto", (10,)) == "mlp"
    assert resolve_model_name("cnn", (3, 64, 64)) == "cnn"


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("mlp", (384,)),
        ("mlp", (1, 8, 8)),
        ("cnn", (1, 8, 8)),
        ("cnn", (1, 28, 28)),
        ("cnn", (3, 8, 20)),
        ("resnet18", (3, 32, 32)),
        ("resnet18", (1, 48, 40)),
    ],
)
def test_forward_shapes(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 7)
    out = model(torch.rand(3, *shape))
    assert out.shape == (3, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_mlp_structure_and_count() -> None:
    model = build_model("mlp", (384,), 10, hidden=512)
    # 384*512 + 512 (hidden) + 512*10 + 10 (head)
    assert count_parameters(model) == 384 * 512 + 512 + 512 * 10 + 10 == 202_250
    assert count_parameters(build_model("mlp", (1, 4, 5), 3, hidden=8)) == 20 * 8 + 8 + 8 * 3 + 3


@pytest.mark.parametrize(("shape", "cells"), [((1, 8, 8), (2, 2)), ((1, 28, 28), (7, 7)),
                                              ((3, 8, 20), (2, 5)), ((3, 31, 40), (7, 10))])
def test_small_cnn_weighs_each_cell_of_the_final_map(shape: tuple[int, ...],
                                                     cells: tuple[int, int]) -> None:
    model = build_model("cnn", shape, 10)
    gdconv = model.features[3]
    assert gdconv.weight.shape == (128, 1, *cells) and gdconv.groups == 128
    assert model.head.in_features == 128
    # 9*C*32 + 9*32*64 + 9*64*128 conv weights (no bias), 2*(32+64+128) BatchNorm, one
    # kernel per channel over the final map, the head
    convs = 9 * shape[0] * 32 + 9 * 32 * 64 + 9 * 64 * 128 + 2 * (32 + 64 + 128)
    assert count_parameters(model) == convs + 128 * cells[0] * cells[1] + 128 * 10 + 10


def test_small_cnn_features_keep_where_a_stroke_is() -> None:
    """The same stroke in two places of a 28x28 image (4 px apart, so that both pools align)
    gives different penultimate features, where a global average pool would give the same."""
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10).eval()
    x = torch.zeros(2, 1, 28, 28)
    x[0, 0, 10:13, 10:13] = 1.0
    x[1, 0, 14:17, 14:17] = 1.0
    with torch.no_grad():
        maps = model.features[:3](x)
        f = penultimate(model, x)
    averaged = maps.mean((2, 3))  # what a global average pool would give
    torch.testing.assert_close(averaged[0], averaged[1])
    assert f.shape == (2, 128)
    assert (f[0] - f[1]).abs().max() > 1e-3


def _hand_count_slim_resnet18(c_in: int, n_classes: int, nf: int = 20) -> int:
    """Conv weights (no bias), BatchNorm weight+bias, linear weight+bias."""
    total = 9 * c_in * nf + 2 * nf  # stem conv + BN
    c = nf
    for i in range(4):
        c_out = nf * 2**i
        total += 9 * c * c_out + 2 * c_out + 9 * c_out * c_out + 2 * c_out  # block 1
        if i > 0:
            total += c * c_out + 2 * c_out  # 1x1 conv shortcut + BN
        total += 2 * (9 * c_out * c_out + 2 * c_out)  # block 2
        c = c_out
    return total + c * n_classes + n_classes


def test_slim_resnet18_parameter_count() -> None:
    model = build_model("resnet18", (3, 32, 32), 10)
    assert model.linear.in_features == 160  # widths 20, 40, 80, 160
    assert count_parameters(model) == _hand_count_slim_resnet18(3, 10) == 1_094_750


def test_bad_names_and_shapes() -> None:
    with pytest.raises(ConfigError, match="unknown model 'vgg'"):
        build_model("vgg", (3, 32, 32), 10)
    with pytest.raises(ConfigError, match="needs image samples"):
        build_model("cnn", (384,), 10)
    with pytest.raises(ConfigError, match="at least 4x4"):
        build_model("cnn", (1, 2, 2), 10)
    with pytest.raises(ConfigError, match="n_classes"):
        build_model("mlp", (10,), 0)


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_batchnorm_momentum_reaches_every_layer(name: str) -> None:
    def momenta(model: torch.nn.Module) -> set[float]:
        return {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}

    assert momenta(build_model(name, (3, 32, 32), 10)) == {BN_MOMENTUM}
    assert momenta(build_model(name, (3, 32, 32), 10, bn_momentum=0.5)) == {0.5}


def test_run_config_sets_the_batchnorm_momentum_and_rejects_bad_values() -> None:
    from edgefcl.build import prepare
    from edgefcl.config import RunConfig, apply, validate

    cfg = apply(RunConfig(), {"learn": {"bn_momentum": 0.7}, "data": {"tasks": 1}})
    model = prepare(cfg, 0).initial
    assert {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.7}
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="bn_momentum must be in"):
            validate(apply(RunConfig(), {"learn": {"bn_momentum": bad}}))

