"""Bayesian layers: conversion, sampling, KL (closed form vs Monte Carlo), posterior
predictions and scores, and the VFCL / FedBNN client objectives."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgefcl.build import new_client
from edgefcl.config import ConfigError, FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.learn.bayes import (
    BayesConv2d,
    BayesLinear,
    bayesian_layers,
    is_bayesian,
    kl_normal,
    mixture_log_prob,
    normal_log_prob,
    posterior_logits,
    posterior_mode,
    predict_logits,
    score_logits,
    softplus_inv,
    to_bayesian,
)
from edgefcl.learn.client import Client
from edgefcl.learn.models import MLP, SlimResNet18, SmallCNN
from edgefcl.learn.scoring.perturb import make_perturber
from edgefcl.learn.variational import VFCLHooks, kl_to, posterior_of


def test_kl_closed_form_hand_value() -> None:
    # KL(N(0,1) || N(1,2^2)) = log 2 + (1 + 1) / 8 - 1/2
    kl = kl_normal(*map(torch.tensor, (0.0, 1.0, 1.0, 2.0)))
    assert float(kl) == pytest.approx(math.log(2) + 0.25 - 0.5, rel=1e-6)
    assert float(kl_normal(*map(torch.tensor, (0.3, 0.7, 0.3, 0.7)))) == pytest.approx(0.0)


def test_kl_matches_monte_carlo_estimate() -> None:
    g = torch.Generator().manual_seed(0)
    mu_q, s_q = torch.tensor([0.2, -1.0, 0.5]), torch.tensor([0.3, 1.5, 0.05])
    mu_p, s_p = torch.tensor([0.0, 0.5, 0.45]), torch.tensor([1.0, 1.0, 0.08])
    w = mu_q + s_q * torch.randn(400_000, 3, generator=g, dtype=torch.float64)
    mc = (normal_log_prob(w, mu_q, s_q) - normal_log_prob(w, mu_p, s_p)).mean(0)
    exact = kl_normal(mu_q, s_q, mu_p, s_p)
    np.testing.assert_allclose(mc.numpy(), exact.numpy(), rtol=0.02, atol=2e-3)


def test_mixture_log_prob() -> None:
    w = torch.tensor([0.1, 2.0])
    a, b = (torch.tensor(0.0), torch.tensor(1.0)), (torch.tensor(2.0), torch.tensor(0.5))
    dens = lambda m, s: torch.exp(-0.5 * ((w - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))  # noqa: E731
    expected = torch.log(0.3 * dens(*a) + 0.7 * dens(*b))
    torch.testing.assert_close(mixture_log_prob(w, 0.3, a, b), expected)
    torch.testing.assert_close(mixture_log_prob(w, 1.0, a, b), normal_log_prob(w, *a))


@pytest.mark.parametrize("model", [MLP(12, 4, hidden=8), SmallCNN(1, 4, (8, 8), width=4),
                                   SlimResNet18(1, 4, nf=2)])
def test_conversion_keeps_mean_function(model) -> None:
    x = torch.randn(3, 12) if isinstance(model, MLP) else torch.randn(3, 1, 8, 8)
    model.eval()
    ref = model(x)
    n_linear = sum(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in model.modules())
    bnn = to_bayesian(model, sigma=0.05)
    assert len(bayesian_layers(bnn)) == n_linear
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in bnn.modules())
    torch.testing.assert_close(bnn(x), ref)  # eval: mean weights
    for _, layer in bayesian_layers(bnn):
        torch.testing.assert_close(layer.sigma("weight"),
                                   torch.full_like(layer.mu("weight"), 0.05))
    assert to_bayesian(bnn, sigma=1.0) is bnn  # already Bayesian: unchanged


def test_conv_layer_matches_conv2d() -> None:
    ref = torch.nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=True)
    layer = BayesConv2d.from_module(ref, 0.1).eval()
    x = torch.randn(2, 2, 7, 7)
    torch.testing.assert_close(layer(x), ref(x))


def test_sampling_modes_and_reparameterised_gradients() -> None:
    layer = BayesLinear(4, 3, sigma=0.5)
    layer.generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4)
    layer.train()
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)
    (a.sum() + b.sum()).backward()
    assert layer.weight_rho.grad is not None and layer.weight_rho.grad.abs().sum() > 0
    layer.eval()
    mean = F.linear(x, layer.weight_mu, layer.bias_mu)
    torch.testing.assert_close(layer(x), mean)
    with posterior_mode(layer, "sample"):
        assert not torch.allclose(layer(x), mean)
    layer.train()
    with posterior_mode(layer, "mean"):
        torch.testing.assert_close(layer(x), mean)
    assert layer.mode == "auto"


def test_sample_statistics_follow_mu_and_sigma() -> None:
    layer = BayesLinear(1, 1, bias=False, sigma=0.3)
    layer.generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.weight_mu.fill_(1.5)
        draws = torch.stack([layer.draw("weight") for _ in range(20_000)]).flatten()
    assert float(draws.mean()) == pytest.approx(1.5, abs=0.01)
    assert float(draws.std()) == pytest.approx(0.3, rel=0.02)
    assert float(softplus_inv(torch.tensor(0.3))) == pytest.approx(math.log(math.expm1(0.3)))


def test_mean_vs_sampled_prediction() -> None:
    torch.manual_seed(0)
    model = to_bayesian(MLP(6, 3, hidden=5), sigma=0.2).eval()
    x = torch.randn(4, 6)
    torch.testing.assert_close(predict_logits(model, x, 0), model(x))
    out = predict_logits(model, x, 5, seed=3)
    torch.testing.assert_close(out, predict_logits(model, x, 5, seed=3))  # same S networks
    assert torch.allclose(out.exp().sum(1), torch.ones(4))
    g = torch.Generator().manual_seed(3)
    for _, layer in bayesian_layers(model):
        layer.generator = g
    with posterior_mode(model, "sample"):
        manual = torch.stack([F.softmax(model(x), -1) for _ in range(5)]).mean(0)
    torch.testing.assert_close(out.exp(), manual)
    # with tiny sigma the posterior average is the mean-weight prediction
    tight = to_bayesian(MLP(6, 3, hidden=5), sigma=1e-7).eval()
    torch.testing.assert_close(predict_logits(tight, x, 4).exp(), F.softmax(tight(x), -1),
                               atol=1e-5, rtol=1e-4)


def test_posterior_score_logits_shapes_and_bn_untouched() -> None:
    torch.manual_seed(0)
    model = to_bayesian(SmallCNN(1, 3, (8, 8), width=4), sigma=0.1)
    x = torch.rand(5, 1, 8, 8)
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)][0]
    before = bn.running_mean.clone()
    pert = make_perturber("image", 4, 0.1, seed=0)
    assert posterior_logits(model, x, 3).shape == (3, 5, 3)
    assert score_logits(model, x, "both", pert, 3).shape == (12, 5, 3)
    assert score_logits(model, x, "posterior", pert, 6).shape == (6, 5, 3)
    assert score_logits(model, x, "tta", pert, 6).shape == (4, 5, 3)
    torch.testing.assert_close(bn.running_mean, before)
    assert model.training  # modes restored
    with pytest.raises(ConfigError, match="Bayesian"):
        score_logits(SmallCNN(1, 3, (8, 8), width=4), x, "posterior", pert, 2)


def _client(method: str, learn: dict | None = None, fed: dict | None = None) -> Client:
    torch.manual_seed(0)
    learn_cfg = LearnConfig(**{"method": method, "memory_size": 20, "perturbations": 3,
                               "local_epochs": 1, **(learn or {})})
    fed_cfg = FedConfig(encoding="gaussian", burn_in=0, jump=1,
                        aggregation={"vfcl": "conflation"}.get(method, "fedbnn"), **(fed or {}))
    return new_client("c0", MLP(8, 4, hidden=6), learn_cfg, fed_cfg, "vector", seed=0)


def _batch(task: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    y = np.array([2 * task, 2 * task + 1] * 3, np.int64)
    return Batch(rng.normal(size=(6, 8)).astype(np.float32), y, task, 1, False)


def test_vfcl_client_sends_gaussians_and_keeps_history() -> None:
    # memory 8 < the 12 samples offered: the second task's batch makes the memory rank
    c = _client("vfcl", {"score_source": "both", "score_samples": 2, "memory_size": 8})
    assert is_bayesian(c.model) and isinstance(c.hooks, VFCLHooks)
    upd = c.step(_batch(0))
    assert upd is not None and upd.encoding == "gaussian"
    assert set(upd.tensors) == {f"net.{i}.{p}::{m}" for i in (1, 3) for p in ("weight", "bias")
                                for m in ("mu", "sigma")}
    assert all((v > 0).all() for k, v in upd.tensors.items() if k.endswith("::sigma"))
    assert c.hooks.history is None
    end_of_task0 = posterior_of(c.model)
    c.step(_batch(1, seed=1))
    assert c.hooks.history is not None
    for k, (mu, s) in end_of_task0.items():
        torch.testing.assert_close(c.hooks.history[k][0], mu)
        torch.testing.assert_close(c.hooks.history[k][1], s)
    assert c.scored > 0  # the memory was ranked with S x P logits


def test_vfcl_penalty_is_the_monte_carlo_mixture_term() -> None:
    c = _client("vfcl", {"lambda_k": 0.3, "vfcl_samples": 1})
    c.step(_batch(0))
    c.hooks.history = {k: (mu + 0.1, s * 2) for k, (mu, s) in posterior_of(c.model).items()}
    c.model.train()
    c.model(torch.randn(4, 8))
    term = c.hooks.prior_term(c)
    expected = 0.0
    for prefix, layer in bayesian_layers(c.model):
        for local in layer.gaussian_names:
            name = f"{prefix}.{local}"
            w, mu, s = layer.last_sample[local], layer.mu(local), layer.sigma(local)
            gm, gs = c.hooks.global_prior[name]
            hm, hs = c.hooks.history[name]
            mix = 0.3 * normal_log_prob(w, gm, gs).exp() + 0.7 * normal_log_prob(w, hm, hs).exp()
            expected += float((normal_log_prob(w, mu, s) - mix.log()).sum().detach())
    assert float(term.detach()) == pytest.approx(expected, rel=1e-4)
    assert float(c.hooks.penalty(c).detach()) == pytest.approx(expected / c.hooks.n_weights,
                                                               rel=1e-4)


def test_fedbnn_client_kl_to_last_global_and_standard_network_start() -> None:
    c = _client("fedbnn", fed={"bnn_init_rounds": 1})
    assert c.hooks.snn and c.hooks.penalty(c) is None and not c.encoder.likelihood
    c.model.train()
    x = torch.randn(3, 8)
    torch.testing.assert_close(c.model(x), c.model(x))  # standard network: mean weights
    c.step(_batch(0))
    sigma = posterior_of(c.model)["net.1.weight"][1]
    torch.testing.assert_close(sigma, torch.full_like(sigma, 0.05))  # rho not trained
    from edgefcl.federation.gaussian import to_wire
    from edgefcl.federation.messages import GlobalModel
    from edgefcl.learn.params import get_tensors

    c.apply_global(GlobalModel(1, to_wire(get_tensors(c.model)), ("c0",)))
    assert not c.hooks.snn and c.encoder.likelihood
    assert float(kl_to(c.model, c.hooks.global_prior).detach()) == pytest.approx(0.0, abs=1e-3)
    c.step(_batch(0, seed=2))
    assert float(kl_to(c.model, c.hooks.global_prior).detach()) > 0


def test_bayesian_clients_are_reproducible_and_copyable() -> None:
    a, b = _client("vfcl"), _client("vfcl")
    ua, ub = a.step(_batch(0)), b.step(_batch(0))
    for k in ua.tensors:
        np.testing.assert_array_equal(ua.tensors[k], ub.tensors[k])
    copy.deepcopy(a.model)  # last draws (graph tensors) are not copied
