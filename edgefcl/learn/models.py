"""Models of the online learners: MLP for vectors, small CNN and slim ResNet-18 for images.

Images come in as (N, C, H, W); anything else (vectors, signals) is flattened by the MLP.
`build_model("auto", ...)` picks the model from the sample shape: vectors -> MLP, images
smaller than 32 px -> small CNN, images of 32 px and more -> slim ResNet-18 (nf = 20).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import BN_MOMENTUM, ConfigError

MODELS = ("auto", "mlp", "cnn", "resnet18")
RESNET_NF = 20
"""Width of the slim ResNet-18 (the GEM / online-CL "reduced ResNet-18")."""
MIN_CNN_SIZE = 4
"""Smallest H and W the small CNN accepts (it pools twice by 2)."""


class MLP(nn.Module):
    """Flatten, one hidden layer of `hidden` units with ReLU, linear head."""

    def __init__(self, in_features: int, n_classes: int, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _conv_block(c_in: int, c_out: int, pool: bool, momentum: float) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out, momentum=momentum),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Three 3x3 conv blocks (32, 64, 128 channels; BatchNorm, ReLU; max-pool after the first
    two), a global depthwise convolution and a linear head. Works for any `size` (H, W) >= 4.

    The global depthwise convolution (MobileFaceNet's GDConv) weighs each channel's final
    map, (H // 4) x (W // 4), with a kernel of its own, where a global average pool would weigh
    every cell alike: three 3x3 convs see about 18 px, so on a 28x28 image an average keeps
    which strokes are present but not where. It adds 128 * (H // 4) * (W // 4) weights (6,272
    for 28x28 images) and keeps 128 features.
    """

    def __init__(self, in_channels: int, n_classes: int, size: tuple[int, int],
                 width: int = 32, bn_momentum: float = BN_MOMENTUM) -> None:
        super().__init__()
        m, c = bn_momentum, 4 * width
        cells = tuple(int(s) // 4 for s in size)
        self.features = nn.Sequential(
            _conv_block(in_channels, width, pool=True, momentum=m),
            _conv_block(width, 2 * width, pool=True, momentum=m),
            _conv_block(2 * width, c, pool=False, momentum=m),
            nn.Conv2d(c, c, cells, groups=c, bias=False),
            nn.Flatten(),
        )
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm, identity or 1x1-conv shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1,
                 bn_momentum: float = BN_MOMENTUM) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out, momentum=bn_momentum)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out, momentum=bn_momentum)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                nn.BatchNorm2d(c_out, momentum=bn_momentum),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SlimResNet18(nn.Module):
    """Reduced ResNet-18 of GEM / online continual learning: BasicBlock x [2, 2, 2, 2] with
    widths nf, 2nf, 4nf, 8nf, a 3x3 stride-1 stem, global average pooling, linear head."""

    def __init__(self, in_channels: int, n_classes: int, nf: int = RESNET_NF,
                 bn_momentum: float = BN_MOMENTUM) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, nf, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(nf, momentum=bn_momentum)
        layers: list[nn.Module] = []
        c_in = nf
        for i, stride in enumerate((1, 2, 2, 2)):
            c_out = nf * 2**i
            layers += [BasicBlock(c_in, c_out, stride, bn_momentum),
                       BasicBlock(c_out, c_out, 1, bn_momentum)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(c_in, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def resolve_model_name(name: str, sample_shape: tuple[int, ...]) -> str:
    """The concrete model `auto` stands for (other names are returned as they are)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    if name != "auto":
        return name
    if len(sample_shape) != 3:
        return "mlp"
    return "cnn" if min(sample_shape[1:]) < 32 else "resnet18"


def build_model(
    name: str, sample_shape: tuple[int, ...], n_classes: int, hidden: int = 512,
    bn_momentum: float = BN_MOMENTUM,
) -> nn.Module:
    """Build a fresh model for samples of `sample_shape` and `n_classes` classes.

    name: auto | mlp | cnn | resnet18. Images have sample_shape (C, H, W); the CNN needs
    H, W >= 4. `hidden` is the MLP's hidden width (ignored by the image models),
    `bn_momentum` the image models' BatchNorm momentum (ignored by the MLP).
    """
    shape = tuple(int(s) for s in sample_shape)
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"sample_shape must be non-empty with positive sizes, got {shape}")
    if n_classes < 1:
        raise ConfigError(f"n_classes must be >= 1, got {n_classes}")
    kind = resolve_model_name(name, shape)
    if kind == "mlp":
        if hidden < 1:
            raise ConfigError(f"hidden must be >= 1, got {hidden}")
        return MLP(math.prod(shape), n_classes, hidden)
    if len(shape) != 3:
        raise ConfigError(
            f"model '{kind}' needs image samples (C, H, W), got shape {shape}; use model=mlp"
        )
    channels, height, width = shape
    if kind == "cnn":
        if min(height, width) < MIN_CNN_SIZE:
            raise ConfigError(
                f"model 'cnn' needs images of at least {MIN_CNN_SIZE}x{MIN_CNN_SIZE} px, got "
                f"{height}x{width}; use model=mlp"
            )
        return SmallCNN(channels, n_classes, (height, width), bn_momentum=bn_momentum)
    return SlimResNet18(channels, n_classes, bn_momentum=bn_momentum)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of `model` (all parameters, trainable or not; no buffers)."""
    return sum(p.numel() for p in model.parameters())


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


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


def penultimate(model: nn.Module, x: Tensor) -> Tensor:
    """Features of `x` before the model's last linear layer, shape (N, d): the CNN's global
    depthwise convolution, the pooled features of the ResNet, the hidden layer of the MLP;
    the logits for any other model. Runs as called (the caller chooses eval mode and
    no-grad). A model with a `features_of` method (the prototype-library model) gives its
    extractor's output."""
    features_of = getattr(model, "features_of", None)
    if callable(features_of):
        return features_of(x)
    if isinstance(model, SmallCNN):
        return model.features(x)
    if isinstance(model, MLP) and isinstance(model.net[-1], nn.Linear):
        return model.net[:-1](x)
    if isinstance(model, SlimResNet18):
        out = model.layers(F.relu(model.bn1(model.conv1(x))))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)
    return model(x)
