"""Mean-field Gaussian (Bayesian) layers, conversion of standard models, closed-form KL and
posterior predictions (docs/algorithms.md §3-4).

Every weight w of a Bayesian layer has a mean mu and rho with sigma = softplus(rho); a training
forward pass draws w = mu + sigma * eps (reparameterisation, one eps per tensor and pass), an
eval forward pass uses the mean weights. `posterior_mode(model, "sample")` makes eval passes
sample too (posterior predictions, memory scores), `"mean"` makes training passes deterministic
(FedBNN's standard-network start). Draws come from the generator set by `set_generator`
(the global RNG when none is set), so runs are reproducible per client.

State names: a Bayesian layer at `net.1` holds `net.1.weight_mu`, `net.1.weight_rho`,
`net.1.bias_mu`, `net.1.bias_rho`; the Gaussian of weight tensor `net.1.weight` is
(`net.1.weight_mu`, softplus(`net.1.weight_rho`)).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import ConfigError
from edgefcl.learn.models import eval_mode, model_device
from edgefcl.learn.scoring.perturb import Perturber, tta_logits

MODES = ("auto", "mean", "sample")
LOG_2PI = math.log(2.0 * math.pi)
SCORE_SOURCES = ("tta", "posterior", "both")


def softplus_inv(sigma: Tensor) -> Tensor:
    """rho with softplus(rho) = sigma (sigma > 0), stable for small and large sigma."""
    return torch.where(sigma > 20.0, sigma, sigma + torch.log(-torch.expm1(-sigma)))


class BayesianLayer(nn.Module):
    """Base of the Bayesian layers: parameters `<name>_mu` and `<name>_rho` for every name in
    `gaussian_names`, weight sampling and the last sample drawn (for Monte Carlo priors)."""

    def __init__(self) -> None:
        super().__init__()
        self.gaussian_names: tuple[str, ...] = ()
        self.mode = "auto"
        self.generator: torch.Generator | None = None
        self.last_sample: dict[str, Tensor] = {}
        self.last_batch = 0

    def __getstate__(self) -> dict:
        # The last draws belong to the autograd graph of the last step: not copied.
        state = dict(super().__getstate__())
        state["last_sample"] = {}
        return state

    def _init_weight_bias(self, ref: nn.Module, sigma: float) -> None:
        """Gaussians over `ref`'s weight (and bias, if it has one), centred on its values."""
        self._init_gaussian("weight", ref.weight, sigma)
        self.has_bias = ref.bias is not None
        if self.has_bias:
            self._init_gaussian("bias", ref.bias, sigma)

    @classmethod
    def from_module(cls, ref: nn.Module, sigma: float) -> BayesianLayer:
        """A Bayesian copy of `ref`: mu = its weights, sigma everywhere."""
        layer = cls.__new__(cls)
        BayesianLayer.__init__(layer)
        layer._init_from(ref, sigma)
        return layer

    def _init_from(self, ref: nn.Module, sigma: float) -> None:
        raise NotImplementedError

    def _init_gaussian(self, name: str, mean: Tensor, sigma: float) -> None:
        if sigma <= 0:
            raise ConfigError(f"initial sigma of Bayesian layers must be > 0, got {sigma}")
        mu = mean.detach().clone()
        rho = softplus_inv(torch.full_like(mu, float(sigma), dtype=torch.float64)).to(mu.dtype)
        self.register_parameter(f"{name}_mu", nn.Parameter(mu))
        self.register_parameter(f"{name}_rho", nn.Parameter(rho))
        self.gaussian_names = (*self.gaussian_names, name)

    def mu(self, name: str) -> Tensor:
        return getattr(self, f"{name}_mu")

    def sigma(self, name: str) -> Tensor:
        """sigma = softplus(rho) of Gaussian `name`."""
        return F.softplus(getattr(self, f"{name}_rho"))

    @property
    def sampling(self) -> bool:
        """Whether the next forward pass draws weights (rather than using the means)."""
        return self.mode == "sample" or (self.mode == "auto" and self.training)

    def draw(self, name: str) -> Tensor:
        """A fresh reparameterised sample mu + sigma * eps of Gaussian `name`."""
        mu = self.mu(name)
        eps = torch.randn(mu.shape, generator=self.generator, device=mu.device, dtype=mu.dtype)
        return mu + self.sigma(name) * eps

    def weights(self, x: Tensor) -> dict[str, Tensor]:
        """The tensors of this forward pass: samples when sampling (kept in `last_sample`),
        else the means."""
        self.last_batch = int(x.shape[0])
        if not self.sampling:
            self.last_sample = {}
            return {n: self.mu(n) for n in self.gaussian_names}
        self.last_sample = {n: self.draw(n) for n in self.gaussian_names}
        return self.last_sample


class BayesLinear(BayesianLayer):
    """Linear layer with a mean-field Gaussian posterior over weight (and bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 sigma: float = 0.05) -> None:
        super().__init__()
        ref = nn.Linear(in_features, out_features, bias=bias)
        self._init_from(ref, sigma)

    def _init_from(self, ref: nn.Linear, sigma: float) -> None:
        self.in_features, self.out_features = ref.in_features, ref.out_features
        self._init_weight_bias(ref, sigma)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weights(x)
        return F.linear(x, w["weight"], w.get("bias"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.has_bias}"


class BayesConv2d(BayesianLayer):
    """2-D convolution with a mean-field Gaussian posterior over kernel (and bias)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = True, sigma: float = 0.05) -> None:
        super().__init__()
        ref = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=bias)
        self._init_from(ref, sigma)

    def _init_from(self, ref: nn.Conv2d, sigma: float) -> None:
        if ref.padding_mode != "zeros" or isinstance(ref.padding, str):
            raise ConfigError("Bayesian conversion supports Conv2d with numeric zero padding, "
                              f"got padding={ref.padding!r} padding_mode={ref.padding_mode!r}")
        self.in_channels, self.out_channels = ref.in_channels, ref.out_channels
        self.kernel_size, self.stride = ref.kernel_size, ref.stride
        self.padding, self.dilation, self.groups = ref.padding, ref.dilation, ref.groups
        self._init_weight_bias(ref, sigma)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weights(x)
        return F.conv2d(x, w["weight"], w.get("bias"), self.stride, self.padding,
                        self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, " \
               f"stride={self.stride}, padding={self.padding}, bias={self.has_bias}"


def to_bayesian(model: nn.Module, sigma: float) -> nn.Module:
    """Swap every nn.Linear / nn.Conv2d of `model` (in place) for a Bayesian layer with
    mu = the deterministic weights and the given sigma; other modules (BatchNorm, ...) stay.
    Returns `model`; a model that is already Bayesian is returned unchanged."""
    if is_bayesian(model):
        return model
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            new: nn.Module = BayesLinear.from_module(child, sigma)
        elif isinstance(child, nn.Conv2d):
            new = BayesConv2d.from_module(child, sigma)
        else:
            to_bayesian(child, sigma)
            continue
        new.train(child.training)
        setattr(model, name, new.to(model_device(child)))
    return model


def bayesian_layers(model: nn.Module) -> list[tuple[str, BayesianLayer]]:
    """(qualified name, layer) of every Bayesian layer, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BayesianLayer)]


def is_bayesian(model: nn.Module) -> bool:
    """Whether `model` has at least one Bayesian layer."""
    return any(isinstance(m, BayesianLayer) for m in model.modules())


def gaussians(model: nn.Module) -> Iterator[tuple[str, BayesianLayer, str]]:
    """(weight tensor name such as 'net.1.weight', layer, local name) of every Gaussian."""
    for prefix, layer in bayesian_layers(model):
        for local in layer.gaussian_names:
            yield (f"{prefix}.{local}" if prefix else local), layer, local


def set_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    """Draw the weight noise of every Bayesian layer from `generator` (on the model's device)."""
    for _, layer in bayesian_layers(model):
        layer.generator = generator


def set_mode(model: nn.Module, mode: str) -> None:
    """auto (sample in training, means in eval) | mean (always the means) | sample (always)."""
    if mode not in MODES:
        raise ConfigError(f"unknown Bayesian mode '{mode}'; choose from {', '.join(MODES)}")
    for _, layer in bayesian_layers(model):
        layer.mode = mode


@contextlib.contextmanager
def posterior_mode(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """Temporarily set every Bayesian layer's mode (see `set_mode`), restoring each after."""
    before = [(layer, layer.mode) for _, layer in bayesian_layers(model)]
    set_mode(model, mode)
    try:
        yield model
    finally:
        for layer, m in before:
            layer.mode = m


# -- densities and divergences ----------------------------------------------------------------
def kl_normal(mu_q: Tensor, sigma_q: Tensor, mu_p: Tensor, sigma_p: Tensor) -> Tensor:
    """Elementwise KL( N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2) ), closed form:
    log(sigma_p / sigma_q) + (sigma_q^2 + (mu_q - mu_p)^2) / (2 sigma_p^2) - 1/2."""
    return (torch.log(sigma_p) - torch.log(sigma_q)
            + (sigma_q**2 + (mu_q - mu_p) ** 2) / (2.0 * sigma_p**2) - 0.5)


def normal_log_prob(w: Tensor, mu: Tensor, sigma: Tensor) -> Tensor:
    """Elementwise log N(w | mu, sigma^2)."""
    return -torch.log(sigma) - 0.5 * LOG_2PI - 0.5 * ((w - mu) / sigma) ** 2


def mixture_log_prob(w: Tensor, weight: float, a: tuple[Tensor, Tensor],
                     b: tuple[Tensor, Tensor]) -> Tensor:
    """Elementwise log( weight N(w | a) + (1 - weight) N(w | b) ), a and b = (mu, sigma)."""
    if weight >= 1.0:
        return normal_log_prob(w, *a)
    if weight <= 0.0:
        return normal_log_prob(w, *b)
    la = normal_log_prob(w, *a) + math.log(weight)
    lb = normal_log_prob(w, *b) + math.log1p(-weight)
    return torch.logaddexp(la, lb)


# -- predictions --------------------------------------------------------------------------------
def _forward_chunked(model: nn.Module, x: Tensor, chunk: int) -> Tensor:
    return torch.cat([model(part) for part in x.split(chunk)])


def posterior_logits(model: nn.Module, x: Tensor, samples: int,
                     perturber: Perturber | None = None, chunk: int = 4096,
                     seed: int | None = None) -> Tensor:
    """Logits from `samples` posterior weight draws, shape (S, N, C); with a perturber every
    draw sees all P views, shape (S * P, N, C) (sample-major). Eval mode (BatchNorm statistics
    do not move), no grad; modes are restored after."""
    if samples < 1:
        raise ConfigError(f"posterior samples must be >= 1, got {samples}")
    if chunk < 1:
        raise ConfigError(f"score_chunk must be >= 1, got {chunk}")
    x = x.to(model_device(model))
    views = perturber(x, seed) if perturber is not None else x.unsqueeze(0)
    flat = views.flatten(0, 1)
    with eval_mode(model), posterior_mode(model, "sample"), torch.no_grad():
        out = torch.stack([_forward_chunked(model, flat, chunk) for _ in range(samples)])
    return out.reshape(samples * views.shape[0], views.shape[1], out.shape[-1])


def score_logits(model: nn.Module, x: Tensor, source: str, perturber: Perturber | None,
                 samples: int, chunk: int = 4096) -> Tensor:
    """The (K, N, C) logits memory scores are computed from: `tta` (P perturbed views, the
    paper's estimate), `posterior` (S weight samples of a Bayesian model) or `both` (S x P)."""
    if source == "tta":
        if perturber is None:
            raise ConfigError("score_source tta needs a perturber")
        return tta_logits(model, x, perturber, chunk)
    if source not in SCORE_SOURCES:
        raise ConfigError(f"unknown score_source '{source}'; choose from "
                          f"{', '.join(SCORE_SOURCES)}")
    if not is_bayesian(model):
        raise ConfigError(f"score_source {source} needs a Bayesian model (encoding gaussian or "
                          "method vfcl/fedbnn); use score_source tta")
    if source == "both" and perturber is None:
        raise ConfigError("score_source both needs a perturber")
    return posterior_logits(model, x, samples, perturber if source == "both" else None, chunk)


def predict_logits(model: nn.Module, x: Tensor, samples: int = 0, seed: int = 0) -> Tensor:
    """Test-time outputs, shape (N, C): the model's logits with mean weights when `samples` is
    0 or the model is not Bayesian, else log of the softmax averaged over `samples` posterior
    draws. The draws come from a generator seeded with `seed` (the same S networks for every
    call, and the training noise does not move)."""
    if samples <= 0 or not is_bayesian(model):
        return model(x)
    layers = [layer for _, layer in bayesian_layers(model)]
    saved = [layer.generator for layer in layers]
    generator = torch.Generator(model_device(model)).manual_seed(seed)
    try:
        for layer in layers:
            layer.generator = generator
        with posterior_mode(model, "sample"):
            logp = torch.stack([F.log_softmax(model(x), -1) for _ in range(samples)])
    finally:
        for layer, g in zip(layers, saved, strict=True):
            layer.generator = g
    return torch.logsumexp(logp, 0) - math.log(samples)
