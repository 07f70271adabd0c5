"""Test-time perturbations (TTA views) and the batched / looped scoring forward passes.

A `Perturber` turns a batch x of shape (N, ...) into P perturbed views, shape (P, N, ...), on
x's device. Randomness: each perturber owns a CPU `torch.Generator` seeded at construction;
every call draws a fresh call seed from it (so repeated calls give fresh views, and the sequence
of views is fixed by the construction seed), or uses the `seed` passed to the call (same seed,
same views). View i of a call is made from the seed mix(call_seed, i) alone, so one view can be
rebuilt on its own (`Perturber.view`), which `tta_logits_looped` uses.

Image views: flips, invert, cutout and brightness are tensor ops, and the geometric views
(rotations, perspective, affine, resized crop; `edgefcl.learn.scoring.warp`) of a call are warped
together in one `grid_sample`. Every random parameter (one draw per image) comes from
`warp.uniforms`, a counter-based generator keyed by the view's seed: the draws of all views of
a call are one vectorized numpy pass, perturbers never touch the global torch RNG, and view i
built alone equals view i of the batched call exactly. Few, cheap operations matter here: the
views are built on the scoring thread while the training thread waits for the GIL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.models import eval_mode, model_device
from edgefcl.learn.scoring.warp import is_geometric, random_map, uniforms, warp

IMAGE_VIEWS = (
    "cutout10",
    "cutout20",
    "hflip",
    "vflip",
    "rotate10",
    "rotate45",
    "rotate90",
    "brightness",
    "perspective",
    "affine",
    "resized_crop",
    "invert",
)
"""The 12 single image augmentations of the paper, in view order."""
MILD_IMAGE_AUGS = ("hflip", "resized_crop", "rotate10", "cutout10")
"""Augmentations `augment_batch` draws from for the extra local training steps."""
DEFAULT_VECTOR_VIEWS = 5
AUGMENT_NOISE_STD = 0.05
"""Default std of the Gaussian noise `augment_batch` adds to vectors."""

BRIGHTNESS = 0.1
"""The brightness view multiplies each image by a factor ~ U(1 - BRIGHTNESS, 1 + BRIGHTNESS)."""

_SEED_SPACE = 2**62


def mix_seed(seed: int, index: int) -> int:
    """A seed for view `index` of a call with seed `seed` (splitmix64-style mixing)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % _SEED_SPACE


def cutout_size(size: int, height: int, width: int) -> int:
    """Cutout side for an image: `size` px at 32 px and above, scaled by min(H, W)/32 below
    (at least 1 px)."""
    side = min(height, width)
    return size if side >= 32 else max(1, round(size * side / 32))


def _cutout(x: Tensor, size: int, u: np.ndarray) -> Tensor:
    """Zero one size x size square per image, its corner drawn from u (N, >= 2)."""
    n, _, h, w = x.shape
    s_h, s_w = min(size, h), min(size, w)
    top = np.floor(u[:, :1] * (h - s_h + 1))
    left = np.floor(u[:, 1:2] * (w - s_w + 1))
    rows, cols = np.arange(h), np.arange(w)
    in_rows = (rows >= top) & (rows < top + s_h)  # (N, H)
    in_cols = (cols >= left) & (cols < left + s_w)  # (N, W)
    mask = in_rows[:, None, :, None] & in_cols[:, None, None, :]
    return x.masked_fill(torch.from_numpy(mask).to(x.device), 0.0)


def _brightness(x: Tensor, u: np.ndarray, amount: float = BRIGHTNESS) -> Tensor:
    factor = 1.0 - amount + 2 * amount * u[:, 0]
    factor = torch.from_numpy(factor).to(device=x.device, dtype=x.dtype)
    return (x.clamp(0.0, 1.0) * factor.reshape(-1, *([1] * (x.ndim - 1)))).clamp(0.0, 1.0)


def brightness(x: Tensor, seed: int, amount: float = BRIGHTNESS) -> Tensor:
    """Each image times its own factor ~ U(1 - amount, 1 + amount), input and output clamped
    to [0, 1] (kornia's / torchvision's ColorJitter brightness)."""
    return _brightness(x, uniforms([seed], x.shape[0])[0], amount)


def _pixel_view(name: str, x: Tensor, u: np.ndarray) -> Tensor:
    """A non-geometric view: cutout<size>, hflip, vflip, invert or brightness; u (N, SLOTS)
    the view's draws."""
    h, w = x.shape[-2:]
    if name.startswith("cutout"):
        return _cutout(x, cutout_size(int(name[len("cutout") :]), h, w), u)
    if name == "hflip":
        return x.flip(-1)
    if name == "vflip":
        return x.flip(-2)
    if name == "invert":
        return 1.0 - x
    if name == "brightness":
        return _brightness(x, u)
    raise ValueError(f"no image augmentation named '{name}'")


def image_views(names: Sequence[str], x: Tensor, seeds: Sequence[int]) -> Tensor:
    """The augmentations `names` (from IMAGE_VIEWS), view i drawn from `seeds[i]`, of a
    (N, C, H, W) batch: shape (len(names), N, C, H, W). The random parameters of all views come
    from one vectorized draw, the maps of each kind of geometric view from one numpy pass, and
    all geometric views are warped in one `grid_sample`; a view depends only on its name, its
    seed and x."""
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    u = uniforms(seeds, n)  # (V, N, SLOTS)
    views: list[Tensor] = [x] * len(names)
    geometric: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if is_geometric(name):
            geometric.setdefault(name, []).append(i)
        else:
            views[i] = _pixel_view(name, x, u[i])
    if geometric:
        maps = np.concatenate([random_map(name, u[idx], h, w) for name, idx in geometric.items()])
        order = [i for idx in geometric.values() for i in idx]
        for i, view in zip(order, warp(x, maps), strict=True):
            views[i] = view
    return torch.stack(views)


def apply_image_aug(name: str, x: Tensor, seed: int) -> Tensor:
    """Apply the single augmentation `name` (one of IMAGE_VIEWS) to a (N, C, H, W) batch."""
    return image_views((name,), x, (seed,))[0]


def _check_images(x: Tensor) -> None:
    if x.ndim != 4 or not x.is_floating_point():
        raise DataError(
            f"image perturbations need a float (N, C, H, W) batch in [0, 1], got "
            f"{x.dtype} of shape {tuple(x.shape)}; use kind='vector' for other data"
        )


class Perturber(ABC):
    """Produces `num_views` perturbed views of a batch: (N, ...) -> (P, N, ...).

    Deterministic for the construction `seed`; a call with `seed=` uses that seed instead of
    the next one from the perturber's own generator.
    """

    kind: str = ""

    def __init__(self, num_views: int, seed: int) -> None:
        if num_views < 1:
            raise ConfigError(f"a perturber needs at least 1 view, got {num_views}")
        self.num_views = num_views
        self._gen = torch.Generator().manual_seed(int(seed))

    def next_seed(self) -> int:
        """Draw the next call seed from the perturber's generator."""
        return int(torch.randint(0, _SEED_SPACE, (1,), generator=self._gen))

    def state_dict(self) -> dict[str, Any]:
        """The generator state (to persist a device across reboots)."""
        return {"rng": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from `state_dict`."""
        self._gen.set_state(state["rng"])

    @abstractmethod
    def check(self, x: Tensor) -> None:
        """Raise DataError when x cannot be perturbed by this perturber."""

    @abstractmethod
    def _view(self, x: Tensor, index: int, seed: int) -> Tensor:
        """View `index` of a checked batch for the view seed `seed`."""

    def view(self, x: Tensor, index: int, seed: int) -> Tensor:
        """View `index` (0 <= index < num_views) of x for the call seed `seed`, shape x.shape."""
        self.check(x)
        if not 0 <= index < self.num_views:
            raise ValueError(f"view index {index} out of range [0, {self.num_views})")
        return self._view(x, index, mix_seed(seed, index))

    def __call__(self, x: Tensor, seed: int | None = None) -> Tensor:
        """All views of x, shape (num_views, N, *x.shape[1:]), on x's device."""
        self.check(x)
        call_seed = self.next_seed() if seed is None else seed
        return torch.stack(
            [self._view(x, i, mix_seed(call_seed, i)) for i in range(self.num_views)]
        )


class ImagePerturber(Perturber):
    """The 12 single image augmentations, each applied on its own to the whole batch (random
    parameters drawn per image); view i is IMAGE_VIEWS[i % 12] (more than 12 views cycle with
    fresh randomness). A call builds all views at once (`image_views`)."""

    kind = "image"

    def check(self, x: Tensor) -> None:
        _check_images(x)

    def view_name(self, index: int) -> str:
        """The augmentation behind view `index`."""
        return IMAGE_VIEWS[index % len(IMAGE_VIEWS)]

    def _view(self, x: Tensor, index: int, seed: int) -> Tensor:
        return apply_image_aug(self.view_name(index), x, seed)

    def __call__(self, x: Tensor, seed: int | None = None) -> Tensor:
        """All views of x, shape (num_views, N, C, H, W), on x's device; the geometric views in
        one warp."""
        self.check(x)
        call_seed = self.next_seed() if seed is None else seed
        names = [self.view_name(i) for i in range(self.num_views)]
        return image_views(names, x, [mix_seed(call_seed, i) for i in range(self.num_views)])


class NoisePerturber(Perturber):
    """Additive Gaussian noise N(0, noise_std^2) per dimension, a fresh draw per view."""

    kind = "vector"

    def __init__(self, num_views: int, noise_std: float, seed: int) -> None:
        super().__init__(num_views, seed)
        if noise_std < 0:
            raise ConfigError(f"noise_std must be >= 0, got {noise_std}")
        self.noise_std = float(noise_std)

    def check(self, x: Tensor) -> None:
        if x.ndim < 2 or not x.is_floating_point():
            raise DataError(
                f"noise perturbations need a float (N, ...) batch, got {x.dtype} of shape "
                f"{tuple(x.shape)}"
            )

    def _view(self, x: Tensor, index: int, seed: int) -> Tensor:
        return add_noise(x, self.noise_std, seed)


def add_noise(x: Tensor, std: float, seed: int) -> Tensor:
    """x plus N(0, std^2) noise drawn on x's device from a generator seeded with `seed`."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
    return x + std * noise


def make_perturber(kind: str, n_views: int, noise_std: float, seed: int) -> Perturber:
    """A perturber for `kind` 'image' or 'vector'.

    image: n_views 0 or 12 -> the 12 augmentations, fewer -> the first n_views, more -> cycle.
    vector: n_views Gaussian noise views of std `noise_std` (0 -> 5 views).
    """
    if n_views < 0:
        raise ConfigError(f"perturbations must be >= 0, got {n_views}")
    if kind == "image":
        return ImagePerturber(n_views or len(IMAGE_VIEWS), seed)
    if kind == "vector":
        return NoisePerturber(n_views or DEFAULT_VECTOR_VIEWS, noise_std, seed)
    raise ConfigError(f"unknown perturbation kind '{kind}'; choose image or vector")


def augment_batch(
    x: Tensor,
    kind: str,
    generator: torch.Generator | None = None,
    noise_std: float = AUGMENT_NOISE_STD,
) -> Tensor:
    """One random mild augmentation of a training batch (the extra local steps).

    Images: one of MILD_IMAGE_AUGS for the whole batch; vectors: N(0, noise_std^2) noise.
    The draws come from `generator` (a CPU generator; None: the global RNG).
    """
    seed = int(torch.randint(0, _SEED_SPACE, (1,), generator=generator))
    if kind == "image":
        _check_images(x)
        pick = int(torch.randint(0, len(MILD_IMAGE_AUGS), (1,), generator=generator))
        return apply_image_aug(MILD_IMAGE_AUGS[pick], x, seed)
    if kind == "vector":
        return add_noise(x, noise_std, seed)
    raise ConfigError(f"unknown augmentation kind '{kind}'; choose image or vector")


def _forward_chunked(model: Callable[[Tensor], Tensor], x: Tensor, chunk: int) -> Tensor:
    return torch.cat([model(part) for part in x.split(chunk)])


def _check_chunk(chunk: int) -> None:
    if chunk < 1:
        raise ConfigError(f"score_chunk must be >= 1, got {chunk}")


def tta_logits(
    model: nn.Module, x: Tensor, perturber: Perturber, chunk: int = 4096, seed: int | None = None
) -> Tensor:
    """Logits of all P views of x, shape (P, N, C), from batched forward passes of at most
    `chunk` samples; eval mode and no grad (BatchNorm statistics do not move), the model's
    modes are restored after. x is moved to the model's device."""
    _check_chunk(chunk)
    x = x.to(model_device(model))
    views = perturber(x, seed)
    with eval_mode(model), torch.no_grad():
        logits = _forward_chunked(model, views.flatten(0, 1), chunk)
    return logits.reshape(views.shape[0], views.shape[1], logits.shape[-1])


def tta_logits_looped(
    model: nn.Module, x: Tensor, perturber: Perturber, chunk: int = 4096, seed: int | None = None
) -> Tensor:
    """Same logits as `tta_logits` for the same seed, built one view at a time (one perturbation
    and one forward per view): the reference implementation the benchmark compares against."""
    _check_chunk(chunk)
    x = x.to(model_device(model))
    call_seed = perturber.next_seed() if seed is None else seed
    with eval_mode(model), torch.no_grad():
        per_view = [
            _forward_chunked(model, perturber.view(x, i, call_seed), chunk)
            for i in range(perturber.num_views)
        ]
    return torch.stack(per_view)
