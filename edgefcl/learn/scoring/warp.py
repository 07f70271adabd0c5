"""Random geometric image transforms, batched: one bilinear `grid_sample` (zeros padding)
warps every image of every geometric view of a call.

A transform is a (3, 3) map from output pixels to source pixels (the inverse of the image's
motion), float64 numpy, in pixel coordinates: (x, y) = (column, row) of a pixel centre, the
top-left pixel at (0, 0). Affine transforms have the bottom row (0, 0, 1); perspective ones are
homographies. Maps are small numpy arrays with any leading shape (views, images): building them
is a few vectorized numpy operations per kind of view, cheap under the GIL while another thread
trains. Their parameters are drawn per image from uniform draws `u` in [0, 1) (last axis: the
draw slots, `SLOTS` of them; `uniforms` makes them from seeds), with the distributions of
kornia 0.9's RandomRotation, RandomAffine, RandomPerspective and RandomResizedCrop
(cropping_mode 'slice'), whose pixel conventions the maps reproduce:

- rotation by `angle` degrees about the image centre ((W - 1) / 2, (H - 1) / 2), a positive
  angle turning the displayed image counter-clockwise; angle ~ U(-d, d);
- affine: rotation by `angle` degrees clockwise and isotropic scale about the centre, then a
  translation; angle ~ U(-20, 20), translation ~ (U(-0.1, 0.1) W, U(-0.3, 0.3) H) pixels,
  scale ~ U(0.5, 0.75);
- perspective: the corners (0, 0), (W-1, 0), (W-1, H-1), (0, H-1) each move inwards by
  U(0, 1) * distortion / 2 * (W, H) pixels (distortion 0.5) and the image follows them;
- resized crop: an integer box of area U(0.8, 1) H W and aspect ratio exp(U(log 0.9,
  log 1.1)) (first of 10 draws that fits, else the whole image) at a uniform integer position,
  resized bilinearly to (H, W) with its corner pixels on the output's corner pixels.

Each map is built elementwise per image, so an image's warp does not depend on which other
images or views share the `grid_sample` call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

AFFINE_DEGREES = 20.0
AFFINE_TRANSLATE = (0.1, 0.3)
AFFINE_SCALE = (0.5, 0.75)
PERSPECTIVE_DISTORTION = 0.5
CROP_SCALE = (0.8, 1.0)
CROP_RATIO = (0.9, 1.1)
CROP_TRIES = 10
SLOTS = 2 * CROP_TRIES + 2
"""Uniform draws per image a view may use (the resized crop uses them all)."""

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def uniforms(seeds: Sequence[int], n: int, slots: int = SLOTS) -> np.ndarray:
    """Uniform draws in [0, 1), shape (len(seeds), n, slots): draw (v, i, k) is the
    splitmix64 output number i * slots + k + 1 of the stream started at seeds[v] (a counter-based
    generator: one vectorized pass for all views, and a view's draws depend on its seed alone)."""
    seed = np.asarray(seeds, dtype=np.uint64).reshape(-1, 1, 1)
    counter = np.arange(1, n * slots + 1, dtype=np.uint64).reshape(1, n, slots)
    z = seed + counter * _GAMMA  # uint64 arithmetic wraps modulo 2**64
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _centre(height: int, width: int) -> tuple[float, float]:
    return (width - 1) / 2, (height - 1) / 2


def _scaled(u: np.ndarray, low: float, high: float) -> np.ndarray:
    return low + (high - low) * u


_Entry = np.ndarray | float


def _affine_rows(a: _Entry, b: _Entry, c: _Entry, d: _Entry, e: _Entry, f: _Entry) -> np.ndarray:
    """Maps (..., 3, 3) with the rows (a, b, c), (d, e, f), (0, 0, 1)."""
    a, b, c, d, e, f = np.broadcast_arrays(a, b, c, d, e, f)
    zero, one = np.zeros_like(a), np.ones_like(a)
    return np.stack([a, b, c, d, e, f, zero, zero, one], axis=-1).reshape(*a.shape, 3, 3)


def _inverse_similarity(cos: np.ndarray, sin: np.ndarray, shift: np.ndarray, height: int,
                        width: int) -> np.ndarray:
    """The map of the motion p -> A (p - c) + c + shift about the centre c, where
    A^-1 = [[cos, sin], [-sin, cos]]: p -> A^-1 (p - c - shift) + c."""
    cx, cy = _centre(height, width)
    dx, dy = shift[..., 0] + cx, shift[..., 1] + cy
    return _affine_rows(cos, sin, cx - (cos * dx + sin * dy), -sin, cos, cy - (cos * dy - sin * dx))


def rotation_map(angle: np.ndarray, height: int, width: int) -> np.ndarray:
    """Maps (..., 3, 3) of rotations by `angle` (...) degrees about the centre, positive
    counter-clockwise as displayed (kornia's `rotate`)."""
    rad = np.radians(np.asarray(angle, dtype=np.float64))
    shift = np.zeros((*rad.shape, 2))
    return _inverse_similarity(np.cos(rad), -np.sin(rad), shift, height, width)


def affine_map(angle: np.ndarray, translate: np.ndarray, scale: np.ndarray, height: int,
               width: int) -> np.ndarray:
    """Maps (..., 3, 3) of kornia's RandomAffine: rotation by `angle` (...) degrees clockwise as
    displayed and scale `scale` (...) about the centre, then a shift by `translate` (..., 2)
    pixels (x, y)."""
    rad = np.radians(np.asarray(angle, dtype=np.float64))
    cos, sin = np.cos(rad) / scale, np.sin(rad) / scale
    return _inverse_similarity(cos, sin, np.asarray(translate, dtype=np.float64), height, width)


def homography(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Homographies (..., 3, 3) sending the 4 points src (..., 4, 2) to dst (..., 4, 2), with
    h22 = 1, from one batched 8 x 8 linear solve."""
    src, dst = np.broadcast_arrays(np.asarray(src, np.float64), np.asarray(dst, np.float64))
    px, py, qx, qy = src[..., 0], src[..., 1], dst[..., 0], dst[..., 1]
    one, zero = np.ones_like(px), np.zeros_like(px)
    rows_x = np.stack([px, py, one, zero, zero, zero, -px * qx, -py * qx], axis=-1)
    rows_y = np.stack([zero, zero, zero, px, py, one, -px * qy, -py * qy], axis=-1)
    a = np.concatenate([rows_x, rows_y], axis=-2)  # (..., 8, 8)
    b = np.concatenate([qx, qy], axis=-1)[..., None]  # (..., 8, 1)
    h = np.linalg.solve(a, b)[..., 0]
    return np.concatenate([h, np.ones((*h.shape[:-1], 1))], axis=-1).reshape(*h.shape[:-1], 3, 3)


def perspective_corners(height: int, width: int) -> np.ndarray:
    """The start corners (4, 2) of kornia's RandomPerspective (a 1-pixel axis spans 1)."""
    x_end, y_end = max(width - 1, 1), max(height - 1, 1)
    return np.array([[0, 0], [x_end, 0], [x_end, y_end], [0, y_end]], dtype=np.float64)


def perspective_map(offset: np.ndarray, height: int, width: int) -> np.ndarray:
    """Maps (..., 3, 3) of perspective warps that move the corners by `offset` (..., 4, 2)
    pixels: the homography from the moved corners back to the corners."""
    start = perspective_corners(height, width)
    return homography(start + offset, start)


def crop_map(box: np.ndarray, height: int, width: int) -> np.ndarray:
    """Maps (..., 3, 3) resizing the integer boxes `box` (..., 4) = (x0, y0, box width, box
    height) to (height, width), corner pixel centres on corner pixel centres (bilinear resize
    with align_corners=True, as kornia's resized crop)."""
    x0, y0, w, h = np.moveaxis(np.asarray(box, dtype=np.float64), -1, 0)
    sx, sy = (w - 1) / max(width - 1, 1), (h - 1) / max(height - 1, 1)
    return _affine_rows(sx, 0.0, x0, 0.0, sy, y0)


def sample_rotation(u: np.ndarray, degrees: float) -> np.ndarray:
    """Angles (...) ~ U(-degrees, degrees) from the draws u (..., SLOTS)."""
    return _scaled(u[..., 0], -degrees, degrees)


def sample_affine(u: np.ndarray, height: int, width: int) -> tuple[np.ndarray, ...]:
    """(angle (...), translate (..., 2) in pixels, scale (...)) of kornia's
    RandomAffine(degrees=20, translate=(0.1, 0.3), scale=(0.5, 0.75)), from u (..., SLOTS)."""
    angle = _scaled(u[..., 0], -AFFINE_DEGREES, AFFINE_DEGREES)
    scale = _scaled(u[..., 1], *AFFINE_SCALE)
    tx = _scaled(u[..., 2], -AFFINE_TRANSLATE[0], AFFINE_TRANSLATE[0]) * width
    ty = _scaled(u[..., 3], -AFFINE_TRANSLATE[1], AFFINE_TRANSLATE[1]) * height
    return angle, np.stack([tx, ty], axis=-1), scale


_INWARDS = np.array([[1, 1], [-1, 1], [-1, -1], [1, -1]], dtype=np.float64)


def sample_perspective(u: np.ndarray, height: int, width: int) -> np.ndarray:
    """Corner offsets (..., 4, 2) of kornia's RandomPerspective(distortion_scale=0.5, 'basic'):
    each corner moves inwards by U(0, 1) * distortion / 2 * size per axis (size W, H; 0 on a
    1-pixel axis), from u (..., SLOTS)."""
    extent = np.array([width if width > 1 else 0, height if height > 1 else 0], np.float64)
    draw = u[..., :8].reshape(*u.shape[:-1], 4, 2)
    return PERSPECTIVE_DISTORTION * extent / 2 * draw * _INWARDS


def sample_crop(u: np.ndarray, height: int, width: int) -> np.ndarray:
    """Boxes (..., 4) = (x0, y0, w, h) of kornia's RandomResizedCrop(scale=(0.8, 1),
    ratio=(0.9, 1.1)) from u (..., SLOTS): the first of 10 (area, ratio) draws whose rounded box
    fits, else the whole image (or the largest box of the extreme ratio when W / H is outside
    the ratio range)."""
    area = _scaled(u[..., :CROP_TRIES], *CROP_SCALE) * (height * width)
    ratio = np.exp(_scaled(u[..., CROP_TRIES : 2 * CROP_TRIES], *np.log(CROP_RATIO)))
    w = np.round(np.sqrt(area * ratio))
    h = np.round(np.sqrt(area / ratio))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.argmax(-1)[..., None]  # the first draw that fits
    in_ratio = width / height
    if in_ratio < CROP_RATIO[0]:
        fallback = (float(width), float(round(width / CROP_RATIO[0])))
    elif in_ratio > CROP_RATIO[1]:
        fallback = (float(round(height * CROP_RATIO[1])), float(height))
    else:
        fallback = (float(width), float(height))
    found = fits.any(-1)
    w = np.clip(np.where(found, np.take_along_axis(w, first, -1)[..., 0], fallback[0]), 1, width)
    h = np.clip(np.where(found, np.take_along_axis(h, first, -1)[..., 0], fallback[1]), 1, height)
    x0 = np.floor(u[..., 2 * CROP_TRIES] * (width - w + 1))
    y0 = np.floor(u[..., 2 * CROP_TRIES + 1] * (height - h + 1))
    return np.stack([x0, y0, w, h], axis=-1)


GEOMETRIC = ("rotate", "affine", "perspective", "resized_crop")
"""Name prefixes of the geometric views (`rotate<degrees>` takes its range from the name)."""


def is_geometric(name: str) -> bool:
    """Whether the view `name` is a geometric warp."""
    return name.startswith(GEOMETRIC)


def random_map(name: str, u: np.ndarray, height: int, width: int) -> np.ndarray:
    """Maps (..., 3, 3) of the geometric view `name`, one per row of the draws u (..., SLOTS)."""
    if name.startswith("rotate"):
        return rotation_map(sample_rotation(u, float(name[len("rotate") :])), height, width)
    if name == "affine":
        return affine_map(*sample_affine(u, height, width), height, width)
    if name == "perspective":
        return perspective_map(sample_perspective(u, height, width), height, width)
    if name == "resized_crop":
        return crop_map(sample_crop(u, height, width), height, width)
    raise ValueError(f"no geometric view named '{name}'")


def _to_grid_units(maps: np.ndarray, height: int, width: int) -> np.ndarray:
    """The maps with their output in grid_sample's [-1, 1] units (align_corners=False):
    (2 p + 1) / size - 1, an affine change of the first two rows."""
    row_x, row_y, row_w = maps[..., 0, :], maps[..., 1, :], maps[..., 2, :]
    x = row_x * (2 / width) + row_w * (1 / width - 1)
    y = row_y * (2 / height) + row_w * (1 / height - 1)
    return np.stack([x, y, row_w], axis=-2)


_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def warp(x: Tensor, maps: np.ndarray) -> Tensor:
    """Warp the (N, C, H, W) batch by the maps (G, N, 3, 3) (output pixel -> source pixel):
    shape (G, N, C, H, W), on x's device, in one bilinear `grid_sample` with zeros padding.

    The G warps of an image are one sampling grid of G * H rows over that image (no copy of x);
    the grid is built elementwise in x's float precision, in numpy (a few operations that
    hold the GIL briefly, where torch operations would hand it to a training thread and back
    at each), and divided by the projective scale only for the views that have one, so each
    image's warp is the same whatever else is in the call."""
    maps = np.asarray(maps, dtype=np.float64)
    g, n, (c, height, width) = maps.shape[0], x.shape[0], x.shape[1:]
    if g == 0 or n == 0:
        return x.new_empty(g, *x.shape)
    dtype = _NUMPY_FLOATS.get(x.dtype, np.float32)  # bfloat16: built in float32, then cast
    units = _to_grid_units(maps, height, width).transpose(1, 2, 3, 0).astype(dtype)
    m = units[..., None, None]  # (N, 3, 3, G, 1, 1)
    cols = np.arange(width, dtype=dtype)  # (W,)
    rows = np.arange(height, dtype=dtype)[:, None]  # (H, 1)
    grid = m[:, :2, 0] * cols + (m[:, :2, 1] * rows + m[:, :2, 2])  # (N, 2, G, H, W)
    projective = np.flatnonzero((maps[:, :, 2, :2] != 0).reshape(g, -1).any(1))
    if projective.size:
        p = m[:, 2][:, :, projective]  # (N, 3, P, 1, 1): the views' bottom rows
        den = p[:, 0] * cols + (p[:, 1] * rows + p[:, 2])  # (N, P, H, W)
        grid[:, :, projective] /= den[:, None]
    grid = grid.reshape(n, 2, g * height, width).transpose(0, 2, 3, 1)  # (N, G*H, W, 2)
    grid_t = torch.from_numpy(np.ascontiguousarray(grid)).to(x.device, x.dtype)
    out = F.grid_sample(x, grid_t, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.reshape(n, c, g, height, width).permute(2, 0, 1, 3, 4)
