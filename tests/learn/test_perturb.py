"""Test-time perturbations, training augmentation and the TTA forward passes."""

from __future__ import annotations

import pytest
import torch

from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.models import build_model
from edgefcl.learn.scoring.perturb import (
    _SEED_SPACE,
    IMAGE_VIEWS,
    MILD_IMAGE_AUGS,
    ImagePerturber,
    apply_image_aug,
    augment_batch,
    brightness,
    cutout_size,
    eval_mode,
    make_perturber,
    mix_seed,
    tta_logits,
    tta_logits_looped,
)
from edgefcl.learn.scoring.warp import uniforms


def _images(n: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_image_views_shape_and_each_view_perturbs(shape: tuple[int, int, int]) -> None:
    x = _images(6, *shape)
    views = make_perturber("image", 0, 0.1, seed=0)(x)
    assert views.shape == (12, 6, *shape)
    assert views.dtype == x.dtype and views.device == x.device
    for i, name in enumerate(IMAGE_VIEWS):
        assert (views[i] - x).abs().amax() > 1e-3, name


def test_view_counts_and_cycling() -> None:
    x = _images(16, 1, 8, 8)
    assert make_perturber("image", 12, 0.1, 0).num_views == 12
    assert make_perturber("image", 5, 0.1, 0)(x).shape[0] == 5
    p = make_perturber("image", 14, 0.1, 0)
    assert isinstance(p, ImagePerturber) and p.view_name(12) == "cutout10"
    views = p(x)
    assert views.shape[0] == 14
    # view 12 is cutout 10 again, with fresh randomness; view 14-1 = 13 is cutout 20 again
    assert not torch.equal(views[12], views[0])
    assert not torch.equal(views[13], views[1])


def test_exact_views_flip_and_invert() -> None:
    x = _images(4, 3, 10, 12)
    views = make_perturber("image", 0, 0.1, 1)(x)
    assert torch.equal(views[IMAGE_VIEWS.index("hflip")], x.flip(-1))
    assert torch.equal(views[IMAGE_VIEWS.index("vflip")], x.flip(-2))
    assert torch.equal(views[IMAGE_VIEWS.index("invert")], 1.0 - x)


@pytest.mark.parametrize(("side", "small", "large"), [(8, 2, 5), (28, 9, 18), (32, 10, 20)])
def test_cutout_sizes(side: int, small: int, large: int) -> None:
    # round(10 * side / 32) and round(20 * side / 32) below 32 px, absolute from 32 px on
    assert cutout_size(10, side, side) == small and cutout_size(20, side, side) == large
    views = make_perturber("image", 2, 0.1, 3)(torch.ones(5, 2, side, side))
    zeros = (views == 0).sum(dim=(2, 3, 4))  # (P, N): zeros per image, over 2 channels
    assert torch.all(zeros[0] == 2 * small**2)
    assert torch.all(zeros[1] == 2 * large**2)
    assert cutout_size(10, 4, 4) == 1 and cutout_size(20, 64, 64) == 20


def test_views_deterministic_for_a_seed() -> None:
    x = _images(5, 3, 16, 16)
    a, b = make_perturber("image", 0, 0.1, 7), make_perturber("image", 0, 0.1, 7)
    first = a(x)
    assert torch.equal(first, b(x))
    assert not torch.equal(a(x), first)  # the next call draws fresh randomness
    assert torch.equal(a(x, seed=11), b(x, seed=11))
    assert not torch.equal(make_perturber("image", 0, 0.1, 8)(x), first)
    # the state can be saved and restored (devices persisting across reboots)
    state = a.state_dict()
    nxt = a(x)
    a.load_state_dict(state)
    assert torch.equal(a(x), nxt)


def test_perturbers_leave_global_rng_alone() -> None:
    x = _images(5, 3, 16, 16)
    p = make_perturber("image", 0, 0.1, 0)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    p(x)
    augment_batch(x, "image", torch.Generator().manual_seed(0))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(("shape", "views"), [((6, 1, 8, 8), 12), ((5, 3, 13, 10), 14)])
def test_each_view_alone_equals_the_batched_view_exactly(
    shape: tuple[int, int, int, int], views: int
) -> None:
    x = _images(*shape)
    p = make_perturber("image", views, 0.1, 0)
    batched = p(x, seed=21)
    for i in range(views):
        assert torch.equal(p.view(x, i, 21), batched[i]), p.view_name(i)
    assert torch.equal(apply_image_aug("hflip", x, 0), x.flip(-1))


def test_brightness_multiplies_each_image_by_its_factor() -> None:
    x = torch.full((64, 2, 3, 3), 0.5)
    x[:, :, 0, 0] = 1.0  # saturates when the factor is above 1
    x[:, :, 0, 1] = 1.5  # out of range: clamped to 1 before the factor
    out = brightness(x, seed=4)
    factor = torch.from_numpy(0.9 + 0.2 * uniforms([4], 64)[0, :, 0])  # the view's first draw
    expected = (0.5 * factor.float())[:, None, None, None].expand(64, 2, 2, 3)
    assert torch.allclose(out[:, :, 1:], expected)
    assert torch.equal(out[:, 0, 0, 0], factor.clamp(max=1.0).float())
    assert torch.equal(out[:, 0, 0, 1], out[:, 0, 0, 0])
    per_image = out[:, 0, 1, 1] / 0.5
    assert 0.9 <= per_image.min() < 0.92 and 1.08 < per_image.max() <= 1.1
    view = make_perturber("image", 8, 0.1, 0).view(x, 7, 3)  # view 7 is brightness
    assert torch.equal(view, brightness(x, mix_seed(3, 7)))


def test_random_views_differ_across_the_batch_and_across_calls() -> None:
    # identical images: every random view draws its parameters per image
    x = _images(1, 1, 12, 12).expand(16, 1, 12, 12).contiguous()
    p = make_perturber("image", 0, 0.1, 0)
    first, second = p(x), p(x)
    for i, name in enumerate(IMAGE_VIEWS):
        if name in ("hflip", "vflip", "invert"):
            assert torch.equal(first[i], second[i])
            continue
        assert not torch.equal(first[i], second[i]), name
        distinct = {tuple(v.flatten().tolist()) for v in first[i]}
        assert len(distinct) > 8, name


def test_augment_batch_is_one_mild_view() -> None:
    x = _images(8, 1, 12, 12)
    gen = torch.Generator().manual_seed(3)
    seed = int(torch.randint(0, _SEED_SPACE, (1,), generator=gen))
    pick = int(torch.randint(0, len(MILD_IMAGE_AUGS), (1,), generator=gen))
    out = augment_batch(x, "image", torch.Generator().manual_seed(3))
    assert torch.equal(out, apply_image_aug(MILD_IMAGE_AUGS[pick], x, seed))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_image_views_on_cuda() -> None:
    x = _images(6, 3, 16, 16)
    p = make_perturber("image", 0, 0.1, 0)
    views = p(x.cuda(), seed=9)
    assert views.device.type == "cuda" and views.shape == (12, *x.shape)
    assert torch.allclose(views.cpu(), p(x, seed=9), atol=1e-5)
    for i in range(12):
        assert torch.equal(p.view(x.cuda(), i, 9), views[i])
    out = augment_batch(x.cuda(), "image", torch.Generator().manual_seed(0))
    assert out.device.type == "cuda"


def test_vector_noise_views() -> None:
    x = torch.randn(200, 384)
    p = make_perturber("vector", 0, 0.1, 0)
    views = p(x)
    assert views.shape == (5, 200, 384)
    noise = views - x
    assert noise.std().item() == pytest.approx(0.1, rel=0.02)
    assert abs(noise.mean().item()) < 2e-3
    assert not torch.equal(views[0], views[1])
    assert torch.equal(make_perturber("vector", 0, 0.1, 0)(x), views)
    assert make_perturber("vector", 3, 0.5, 0)(x).shape == (3, 200, 384)


def test_augment_batch() -> None:
    x = _images(8, 1, 12, 12)
    outs = [augment_batch(x, "image", torch.Generator().manual_seed(s)) for s in range(6)]
    for out in outs:
        assert out.shape == x.shape and (out - x).abs().amax() > 1e-3
    again = augment_batch(x, "image", torch.Generator().manual_seed(0))
    assert torch.equal(again, outs[0])
    v = torch.zeros(100, 300)
    noisy = augment_batch(v, "vector", torch.Generator().manual_seed(0), noise_std=0.05)
    assert noisy.std().item() == pytest.approx(0.05, rel=0.03)


def test_bad_input_errors() -> None:
    with pytest.raises(DataError, match=r"\(N, C, H, W\)"):
        make_perturber("image", 0, 0.1, 0)(torch.rand(4, 10))
    with pytest.raises(DataError, match="float"):
        make_perturber("vector", 0, 0.1, 0)(torch.ones(4, 10, dtype=torch.long))
    with pytest.raises(ConfigError, match="kind 'audio'"):
        make_perturber("audio", 0, 0.1, 0)
    with pytest.raises(ConfigError, match=">= 0"):
        make_perturber("image", -1, 0.1, 0)
    with pytest.raises(ConfigError, match="noise_std"):
        make_perturber("vector", 0, -0.1, 0)
    with pytest.raises(ConfigError, match="kind 'audio'"):
        augment_batch(torch.rand(4, 10), "audio")


def _trained_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 5)
    model(torch.rand(32, 1, 8, 8) * 3)  # move BN running stats away from their init
    return model


def test_tta_logits_chunking_and_eval_mode() -> None:
    model = _trained_cnn()
    x = _images(4, 1, 8, 8)
    p = make_perturber("image", 0, 0.1, 0)
    full = tta_logits(model, x, p, chunk=4096, seed=5)
    assert full.shape == (12, 4, 5)
    for chunk in (5, 13, 48):
        assert torch.allclose(tta_logits(model, x, p, chunk=chunk, seed=5), full, atol=1e-5)
    # the logits are the eval-mode logits of the views
    views = p(x, seed=5)
    model.eval()
    with torch.no_grad():
        expected = model(views.flatten(0, 1)).reshape(12, 4, 5)
    assert torch.allclose(full, expected, atol=1e-5)
    with pytest.raises(ConfigError, match="score_chunk"):
        tta_logits(model, x, p, chunk=0)


def test_tta_logits_leave_batchnorm_and_modes_alone() -> None:
    model = _trained_cnn()
    model.train()
    frozen = model.features[0]
    frozen.eval()  # a submodule the caller keeps in eval mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = make_perturber("image", 0, 0.1, 0)
    tta_logits(model, _images(6, 1, 8, 8), p, chunk=10)
    tta_logits_looped(model, _images(6, 1, 8, 8), p, chunk=10)
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert model.training and model.features[1].training and not frozen.training
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and not frozen.training


@pytest.mark.parametrize("kind", ["image", "vector"])
def test_looped_equals_batched(kind: str) -> None:
    if kind == "image":
        model, x = _trained_cnn(), _images(6, 1, 8, 8)
    else:
        torch.manual_seed(0)
        model, x = build_model("mlp", (20,), 4, hidden=16), torch.randn(9, 20)
    batched = tta_logits(model, x, make_perturber(kind, 0, 0.1, 3), chunk=8)
    looped = tta_logits_looped(model, x, make_perturber(kind, 0, 0.1, 3), chunk=8)
    assert looped.shape == batched.shape
    assert torch.allclose(looped, batched, atol=1e-5)


def test_tta_logits_empty_batch() -> None:
    model = _trained_cnn()
    out = tta_logits(model, torch.rand(0, 1, 8, 8), make_perturber("image", 0, 0.1, 0))
    assert out.shape == (12, 0, 5)
