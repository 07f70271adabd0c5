"""Batched geometric image warps (edgefcl.learn.scoring.warp): maps, samplers, grid_sample."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgefcl.learn.scoring import warp as W

F64 = torch.float64


def _images(n: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _u(n: int, seed: int = 0) -> np.ndarray:
    return W.uniforms([seed], n)[0]


def _warp1(x: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    return W.warp(x, maps[None])[0]


@pytest.mark.parametrize("side", [7, 8])
@pytest.mark.parametrize("k", [1, -1, 2])
def test_rotation_by_multiples_of_90_is_rot90(side: int, k: int) -> None:
    # about the centre ((side-1)/2, (side-1)/2) pixel centres land on pixel centres; a positive
    # angle turns the displayed image counter-clockwise, as torch.rot90 with dims (H, W)
    x = _images(3, 2, side, side)
    out = _warp1(x, W.rotation_map(np.full(3, 90.0 * k), side, side))
    assert torch.allclose(out, torch.rot90(x, k, dims=(-2, -1)), atol=1e-12)


def test_identity_parameters_give_the_input_back() -> None:
    x = _images(4, 3, 9, 12)
    n, zeros = 4, np.zeros(4)
    maps = np.stack([
        W.rotation_map(zeros, 9, 12),
        W.affine_map(zeros, np.zeros((n, 2)), np.ones(n), 9, 12),
        W.perspective_map(np.zeros((n, 4, 2)), 9, 12),
        W.crop_map(np.tile([0.0, 0.0, 12.0, 9.0], (n, 1)), 9, 12),
    ])
    np.testing.assert_allclose(maps, np.broadcast_to(np.eye(3), maps.shape), atol=1e-12)
    out = W.warp(x, maps)
    assert out.shape == (4, *x.shape)
    assert torch.allclose(out, x.expand_as(out), atol=1e-12)


def test_translation_shifts_pixels_and_pads_with_zeros() -> None:
    x = _images(2, 1, 6, 7)
    shift = np.array([[2.0, 1.0], [-1.0, -3.0]])
    out = _warp1(x, W.affine_map(np.zeros(2), shift, np.ones(2), 6, 7))
    expected = torch.zeros_like(x)
    expected[0, :, 1:, 2:] = x[0, :, :-1, :-2]  # moved right 2, down 1
    expected[1, :, :-3, :-1] = x[1, :, 3:, 1:]  # moved left 1, up 3
    assert torch.allclose(out, expected, atol=1e-12)


def test_affine_scale_and_angle_about_the_centre() -> None:
    # scale 0.5 about the centre (2, 2) of a 5x5 image: output (2 + d) samples source (2 + 2d)
    x = _images(1, 1, 5, 5)
    out = _warp1(x, W.affine_map(np.zeros(1), np.zeros((1, 2)), np.array([0.5]), 5, 5))
    assert torch.allclose(out[0, 0, 1:4, 1:4], x[0, 0, 0:5:2, 0:5:2], atol=1e-12)
    # kornia's RandomAffine turns clockwise for a positive angle: the opposite of rotation_map
    m = W.affine_map(np.array([30.0]), np.zeros((1, 2)), np.ones(1), 5, 5)
    np.testing.assert_allclose(m, W.rotation_map(np.array([-30.0]), 5, 5), atol=1e-15)


def test_warps_match_kornia_reference_values() -> None:
    # outputs of kornia 0.9's RandomRotation / RandomAffine / RandomPerspective on this 4x5
    # image with these forced parameters (float64, x 19, rounded to 4 decimals)
    x = torch.arange(20, dtype=F64).reshape(1, 1, 4, 5) / 19.0
    rot = [[0.2046, 1.3206, 3.7548, 7.1208, 5.182], [0.8529, 4.2189, 7.5849, 10.951, 14.317],
           [4.683, 8.049, 11.4151, 14.7811, 18.1471], [4.6591, 11.8792, 15.2452, 11.9977, 3.6137]]
    aff = [[0.0, 2.773, 4.6303, 4.0834, 2.3056], [0.0, 12.6226, 13.1111, 12.5641, 2.8358],
           [0.0, 0.0, 1.2487, 9.3776, 0.0], [0.0] * 5]
    per = [[0.0, 0.1802, 0.0, 0.0, 0.0], [1.2378, 7.0699, 6.8173, 6.5413, 0.0],
           [0.7709, 15.0214, 15.1112, 15.2083, 3.5008], [0.0, 0.0, 0.0, 2.1173, 5.9445]]
    offset = np.array([[[0.5, 0.25], [-1.0, 0.75], [-0.25, -0.5], [0.75, -1.0]]])
    maps = np.stack([
        W.rotation_map(np.array([30.0]), 4, 5),
        W.affine_map(np.array([15.0]), np.array([[0.4, -0.9]]), np.array([0.6]), 4, 5),
        W.perspective_map(offset, 4, 5),
    ])
    out = W.warp(x, maps)[:, 0, 0] * 19
    assert torch.allclose(out, torch.tensor([rot, aff, per], dtype=F64), atol=1e-4)


def test_resized_crop_corners_on_corners() -> None:
    # box x 1..4, y 0..2 stretched over 5 x 4 pixels: column u samples 1 + 3u/4, row v 2v/3
    x = torch.arange(20, dtype=F64).reshape(1, 1, 4, 5)
    out = _warp1(x, W.crop_map(np.array([[1.0, 0.0, 4.0, 3.0]]), 4, 5))
    u, v = torch.arange(5, dtype=F64), torch.arange(4, dtype=F64)[:, None]
    assert torch.allclose(out[0, 0], (2 * v / 3) * 5 + 1 + 3 * u / 4, atol=1e-12)


def test_perspective_moves_the_corners() -> None:
    # the image's corner pixels follow the displaced corners: a map sends each moved corner
    # back to its start corner
    offset = W.sample_perspective(_u(5, 3), 8, 10)
    maps = W.perspective_map(offset, 8, 10)
    start = W.perspective_corners(8, 10)
    end = np.concatenate([start + offset, np.ones((5, 4, 1))], axis=-1)
    back = np.einsum("nij,nkj->nki", maps, end)
    np.testing.assert_allclose(back[..., :2] / back[..., 2:], np.broadcast_to(start, (5, 4, 2)),
                               atol=1e-9)


def test_homography_solves_four_points() -> None:
    src = np.array([[[0.0, 0.0], [4.0, 0.0], [4.0, 3.0], [0.0, 3.0]]])
    dst = np.array([[[1.0, 0.5], [5.0, 0.0], [4.5, 3.5], [0.0, 2.0]]])
    h = W.homography(src, dst)
    pts = np.concatenate([src, np.ones((1, 4, 1))], axis=-1) @ h.transpose(0, 2, 1)
    np.testing.assert_allclose(pts[..., :2] / pts[..., 2:], dst, atol=1e-12)
    assert h[0, 2, 2] == 1.0


def test_parameter_ranges_over_many_draws() -> None:
    n, h, w = 20000, 28, 28
    angle = W.sample_rotation(_u(n, 0), 45.0)
    assert np.abs(angle).max() <= 45.0 and angle.min() < -44.0 and angle.max() > 44.0
    angle, shift, scale = W.sample_affine(_u(n, 1), h, w)
    assert np.abs(angle).max() <= 20.0 and np.abs(angle).max() > 19.9
    assert scale.min() >= 0.5 and scale.max() <= 0.75 and scale.max() - scale.min() > 0.24
    assert np.abs(shift[:, 0]).max() <= 0.1 * w and np.abs(shift[:, 0]).max() > 0.099 * w
    assert np.abs(shift[:, 1]).max() <= 0.3 * h and np.abs(shift[:, 1]).max() > 0.299 * h
    # perspective: every corner moves inwards, by at most 0.25 of the side along each axis
    offset = W.sample_perspective(_u(n, 2), h, w)
    inwards = np.array([[1, 1], [-1, 1], [-1, -1], [1, -1]])
    along = offset * inwards
    assert along.min() >= 0 and along.max() <= 0.25 * w and along.max() > 0.249 * w
    # resized crop: integer boxes inside the image, area 0.8-1 (+ rounding), ratio 0.9-1.1
    box = W.sample_crop(_u(n, 4), h, w)
    x0, y0, bw, bh = box.T
    assert np.array_equal(box, box.round()) and x0.min() >= 0 and y0.min() >= 0
    assert (x0 + bw).max() <= w and (y0 + bh).max() <= h
    area = bw * bh / (h * w)
    assert area.min() >= 0.8 * (1 - 1 / 26) ** 2 and area.max() <= 1.0
    assert (bw / bh).min() >= 0.9 * 26 / 28 and (bw / bh).max() <= 1.1 * 28 / 26
    assert x0.max() > 0 and y0.max() > 0 and bw.min() < bw.max()


def test_crop_falls_back_for_a_wide_image() -> None:
    # W / H = 3 is outside the ratio range: no draw fits, the box is H x round(1.1 H)
    box = W.sample_crop(_u(50, 0), 4, 12)
    assert np.all(box[:, 2] == 4) and np.all(box[:, 3] == 4)
    assert box[:, 0].max() <= 8 and box[:, 1].max() == 0


def test_samplers_deterministic_per_seed_and_global_rng_untouched() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    for name in ("rotate45", "affine", "perspective", "resized_crop"):
        first = W.random_map(name, _u(8, 7), 10, 12)
        assert np.array_equal(first, W.random_map(name, _u(8, 7), 10, 12))
        assert not np.array_equal(first, W.random_map(name, _u(8, 8), 10, 12))
        # one draw per image: the maps differ across the batch
        assert not np.array_equal(first[0], first[1])
    W.warp(_images(8, 1, 10, 12).float(), W.random_map("affine", _u(8, 0), 10, 12)[None])
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match="no geometric view named 'shear'"):
        W.random_map("shear", _u(8, 0), 10, 12)


def test_one_warp_per_view_equals_the_joint_warp() -> None:
    x = _images(5, 3, 9, 11).float()
    names = ("rotate10", "perspective", "affine", "resized_crop", "rotate90")
    maps = np.stack([W.random_map(n, _u(5, i), 9, 11) for i, n in enumerate(names)])
    joint = W.warp(x, maps)
    assert joint.shape == (5, *x.shape) and joint.dtype == x.dtype
    for i in range(len(names)):
        assert torch.equal(joint[i], _warp1(x, maps[i]))
        assert torch.equal(joint[i, 2:], _warp1(x[2:], maps[i, 2:]))  # nor the other images


def test_warp_empty_and_tiny_images() -> None:
    assert W.warp(torch.rand(0, 1, 8, 8), np.zeros((3, 0, 3, 3))).shape == (3, 0, 1, 8, 8)
    x = torch.rand(4, 1, 1, 1)
    for name in ("rotate45", "affine", "perspective", "resized_crop"):
        out = _warp1(x, W.random_map(name, _u(4, 0), 1, 1))
        assert out.shape == x.shape and torch.isfinite(out).all()
    out = _warp1(x, W.random_map("perspective", _u(4, 0), 1, 1))
    assert torch.allclose(out, x)  # no corner offset on a 1-pixel axis


def test_angles_are_degrees() -> None:
    m = W.rotation_map(np.array([30.0]), 5, 5)
    assert m[0, 0, 0] == pytest.approx(math.cos(math.pi / 6))
    assert m[0, 1, 0] == pytest.approx(math.sin(math.pi / 6))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warp_on_cuda_matches_cpu() -> None:
    x = _images(6, 3, 12, 12).float()
    names = ("rotate45", "perspective", "affine", "resized_crop")
    maps = np.stack([W.random_map(n, _u(6, i), 12, 12) for i, n in enumerate(names)])
    out = W.warp(x.cuda(), maps)
    assert out.device.type == "cuda"
    assert torch.allclose(out.cpu(), W.warp(x, maps), atol=1e-5)
    for i in range(len(names)):
        assert torch.equal(out[i], _warp1(x.cuda(), maps[i]))


def test_uniforms_are_per_seed_and_uniform() -> None:
    u = W.uniforms([3, 7, 2**62 - 1], 50)
    assert u.shape == (3, 50, W.SLOTS) and u.dtype == np.float64
    assert u.min() >= 0.0 and u.max() < 1.0
    # a view's draws depend on its own seed alone, not on the other views of the call
    np.testing.assert_array_equal(u[1], W.uniforms([7], 50)[0])
    np.testing.assert_array_equal(u[1, :10], W.uniforms([7], 10)[0])
    # uniform, and neighbouring seeds / slots uncorrelated (n = 1e6: std error 1e-3)
    big = W.uniforms(range(1000), 50)
    counts = np.histogram(big, bins=10, range=(0, 1))[0] / big.size
    assert np.abs(counts - 0.1).max() < 0.003
    assert abs(np.corrcoef(big[:-1].ravel(), big[1:].ravel())[0, 1]) < 0.005
    assert abs(np.corrcoef(big[..., 0].ravel(), big[..., 1].ravel())[0, 1]) < 0.01
