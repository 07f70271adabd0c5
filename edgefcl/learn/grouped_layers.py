"""The stacked forward of many models of one layer chain, written with batched matrix products.

`torch.func.vmap` of `functional_call` runs any model stacked, but on CPU its Python layers
cost more than a small model's arithmetic: a stacked step of the MNIST-1D MLP (40-512-10, 20
samples, 5 clients) spent a third of its time in them. A model that is a chain of Flatten,
Linear and ReLU layers (the MLP) runs here instead with one `torch.baddbmm` per Linear over
the clients' stacked weights: the same arithmetic (each client's logits within float
tolerance of its own forward), without vmap. Any other model returns None (`grouped_forward`)
and keeps the vmap forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from edgefcl.learn.models import MLP

StackedForward = Callable[[dict[str, Tensor], dict[str, Tensor], Tensor], Tensor]
"""(stacked parameters by name, stacked buffers by name, inputs (K, N, ...)) -> (K, N, C)."""


def _chain(model: nn.Module) -> tuple[str, nn.Sequential] | None:
    """The prefix of the parameter names and the layer chain `model`'s forward runs, for the
    models that are one chain (the MLP); None for the others."""
    return ("net.", model.net) if isinstance(model, MLP) else None


def grouped_forward(model: nn.Module) -> StackedForward | None:
    """The stacked forward of models like `model`, or None when it is not one chain of
    Flatten (before the first Linear), Linear and ReLU layers with at least one Linear.

    From the first Linear on, the activations run features first, (K, F, N): each weight's
    gradient then comes as one product in the weight's own layout, where (K, N, F) gave it
    transposed, and the optimizer's kernel needed a copy of it (a tenth of a stacked step of
    the MNIST-1D MLP)."""
    found = _chain(model)
    if found is None:
        return None
    prefix, chain = found
    steps: list[Callable[[dict[str, Tensor], Tensor], Tensor]] = []
    features_first = False
    for i, layer in enumerate(chain):
        if isinstance(layer, nn.Linear):
            if not features_first:
                steps.append(lambda _, x: x.transpose(1, 2))
                features_first = True
            steps.append(_linear(f"{prefix}{i}.", layer.bias is not None))
        elif isinstance(layer, nn.ReLU):
            steps.append(lambda _, x: torch.relu(x))
        elif (isinstance(layer, nn.Flatten) and layer.start_dim == 1 and layer.end_dim == -1
              and not features_first):
            steps.append(lambda _, x: x.flatten(2))  # keeps the clients' and samples' axes
        else:
            return None
    if not features_first:
        return None

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        for step in steps:
            x = step(params, x)
        return x.transpose(1, 2)

    return forward


def _linear(name: str, bias: bool) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    """x (K, in, N) -> (K, out, N) with each client's own weight (K, out, in) and bias."""
    def linear(params: dict[str, Tensor], x: Tensor) -> Tensor:
        if not bias:
            return torch.bmm(params[name + "weight"], x)
        return torch.baddbmm(params[name + "bias"].unsqueeze(2), params[name + "weight"], x)
    return linear
