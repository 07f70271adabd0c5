"""The stacked forward of a Linear chain by batched matrix products: each model's own logits."""

from __future__ import annotations

import torch
from torch import nn

from edgefcl.learn.grouped_layers import grouped_forward
from edgefcl.learn.models import MLP, build_model


def stacked(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    names = [n for n, _ in models[0].named_parameters()]
    return {n: torch.stack([dict(m.named_parameters())[n] for m in models]) for n in names}


def test_a_linear_chain_gives_each_model_its_own_logits_and_gradients():
    torch.manual_seed(0)
    models = [MLP(12, 5, hidden=7) for _ in range(3)]
    x = torch.randn(3, 4, 3, 4)  # each model's own 4 samples of 3 x 4 (flattened to 12)
    forward = grouped_forward(models[0])
    assert forward is not None
    params = {n: p.detach().clone().requires_grad_() for n, p in stacked(models).items()}
    logits = forward(params, {}, x)
    assert logits.shape == (3, 4, 5)
    logits.square().sum().backward()
    for k, model in enumerate(models):
        own = model(x[k])
        torch.testing.assert_close(logits[k], own)
        own.square().sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name].grad[k], p.grad)


def test_a_model_with_other_layers_keeps_the_vmap_forward():
    assert grouped_forward(build_model("cnn", (1, 8, 8), 4)) is None
    assert grouped_forward(nn.Sequential(nn.Linear(3, 2))) is None  # not a known chain
    mlp = MLP(4, 2, hidden=3)
    mlp.net[2] = nn.Tanh()
    assert grouped_forward(mlp) is None
