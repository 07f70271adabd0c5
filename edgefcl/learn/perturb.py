"""Test-time perturbations (TTA views) and the batched / looped scoring forward passes.

A `Perturber` turns a batch x of shape (N, ...) into P perturbed views, shape (P, N, ...), on
x's device. Randomness: each perturber owns a CPU `torch.Generator` seeded at construction;
every call draws a fresh call seed from it (so repeated calls give fresh views, and the sequence
of views is fixed by the construction seed), or uses the `seed` passed to the call (same seed,
same views). View i of a call is made from the seed mix(call_seed, i) alone, so one view can be
rebuilt on its own (`Perturber.view`), which `tta_logits_looped` uses.

Perturbers never consume the global torch RNG: kornia draws its parameters from the global CPU
RNG, so kornia calls run inside `torch.random.fork_rng` seeded with the view seed (serialised by
a lock) and the caller's RNG stream is left where it was.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import kornia.augmentation as KA
import torch
from torch import Tensor, nn

from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.models import model_device

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

_SEED_SPACE = 2**62
_KORNIA_LOCK = threading.RLock()


def mix_seed(seed: int, index: int) -> int:
    """A seed for view `index` of a call with seed `seed` (splitmix64-style mixing)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % _SEED_SPACE


@contextlib.contextmanager
def _global_rng_seeded(seed: int) -> Iterator[None]:
    """Run with the global CPU RNG seeded to `seed`, restoring the caller's RNG state after."""
    with _KORNIA_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def cutout_size(size: int, height: int, width: int) -> int:
    """Cutout side for an image: `size` px at 32 px and above, scaled by min(H, W)/32 below
    (at least 1 px)."""
    side = min(height, width)
    return size if side >= 32 else max(1, round(size * side / 32))


def cutout(x: Tensor, size: int, seed: int) -> Tensor:
    """Zero one size x size square per image, placed uniformly inside the image."""
    n, _, h, w = x.shape
    s_h, s_w = min(size, h), min(size, w)
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(0, h - s_h + 1, (n, 1), generator=gen).to(x.device)
    left = torch.randint(0, w - s_w + 1, (n, 1), generator=gen).to(x.device)
    rows = torch.arange(h, device=x.device)[None, :]
    cols = torch.arange(w, device=x.device)[None, :]
    in_rows = (rows >= top) & (rows < top + s_h)
    in_cols = (cols >= left) & (cols < left + s_w)
    mask = in_rows[:, None, :, None] & in_cols[:, None, None, :]
    return x.masked_fill(mask, 0.0)


@functools.lru_cache(maxsize=64)
def _kornia_aug(name: str, height: int, width: int) -> nn.Module:
    """The kornia augmentation (p = 1.0: always applied) behind a view name."""
    if name.startswith("rotate"):
        return KA.RandomRotation(degrees=float(name[len("rotate") :]), p=1.0)
    if name == "brightness":
        return KA.ColorJitter(brightness=0.1, p=1.0)
    if name == "perspective":
        return KA.RandomPerspective(distortion_scale=0.5, p=1.0)
    if name == "affine":
        return KA.RandomAffine(degrees=20.0, translate=(0.1, 0.3), scale=(0.5, 0.75), p=1.0)
    if name == "resized_crop":
        return KA.RandomResizedCrop((height, width), scale=(0.8, 1.0), ratio=(0.9, 1.1), p=1.0)
    raise ValueError(f"no kornia augmentation named '{name}'")


def apply_image_aug(name: str, x: Tensor, seed: int) -> Tensor:
    """Apply the single augmentation `name` (one of IMAGE_VIEWS) to a (N, C, H, W) batch."""
    h, w = x.shape[-2:]
    if name.startswith("cutout"):
        return cutout(x, cutout_size(int(name[len("cutout") :]), h, w), seed)
    if name == "hflip":
        return x.flip(-1)
    if name == "vflip":
        return x.flip(-2)
    if name == "invert":
        return 1.0 - x
    aug = _kornia_aug(name, h, w)
    with _global_rng_seeded(seed):
        return aug(x)


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
    """The 12 single image augmentations, each applied on its own to the whole batch; view i
    is IMAGE_VIEWS[i % 12] (more than 12 views cycle with fresh randomness)."""

    kind = "image"

    def check(self, x: Tensor) -> None:
        _check_images(x)

    def view_name(self, index: int) -> str:
        """The augmentation behind view `index`."""
        return IMAGE_VIEWS[index % len(IMAGE_VIEWS)]

    def _view(self, x: Tensor, index: int, seed: int) -> Tensor:
        return apply_image_aug(self.view_name(index), x, seed)


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


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode and restore each one's own mode on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


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
