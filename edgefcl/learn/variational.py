"""Client objectives of Bayesian models (docs/algorithms.md §3-4), as method hooks.

- `BayesHooks`: Bayes by Backprop with the last global posterior as prior,
  loss = CE + lambda_p * KL(q || N(global)) / N. Used by `fedbnn` and by every other method that
  runs with the gaussian encoding (e.g. `bi+gaussian/conflation`: BI memory, Bayesian model).
- `VFCLHooks` (`vfcl`): mixture prior lambda_k N(global) + (1 - lambda_k) N(history), where the
  history is the client's posterior when its current task started (at the last task boundary);
  loss = CE + lambda_p * mean_s [log q(w_s) - log p~(w_s)] / N over n Monte Carlo draws w_s
  (the first is the draw of the forward pass). Before the first boundary there is no history
  and the closed-form KL to the global is used.
N normalises the prior term per sample (`kl_scale samples`: the samples of the current task seen
so far plus this step's), or per parameter (`kl_scale params`: the mean over all weights, as the
FedBNN reference code). With the fedbnn aggregation, the client sends its likelihood (posterior
/ prior) and, for the first `bnn_init_rounds` global versions, trains as a standard network
(mean weights, no prior term; sigma stays at its initial value, so the conversion to the
Bayesian phase starts from sigma = bayes_sigma).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import ConfigError, FedConfig, LearnConfig
from edgefcl.federation.gaussian import STATE_MU, STATE_RHO, GaussianEncoder
from edgefcl.federation.registry import get_encoding, get_rule
from edgefcl.learn.bayes import (
    gaussians,
    kl_normal,
    mixture_log_prob,
    normal_log_prob,
    set_generator,
    set_mode,
    to_bayesian,
)
from edgefcl.learn.methods import get_method
from edgefcl.learn.objectives import MethodHooks, make_hooks
from edgefcl.learn.views import ClientView

if TYPE_CHECKING:
    from edgefcl.federation.messages import GlobalModel, Tensors

Prior = dict[str, tuple[Tensor, Tensor]]
"""Weight tensor name -> (mu, sigma), detached."""


def prior_from_state(state: Tensors, names: list[str], device: torch.device) -> Prior:
    """(mu, softplus(rho)) of every Gaussian `names` from a model state (W_mu, W_rho)."""
    out: Prior = {}
    for n in names:
        mu = torch.from_numpy(np.asarray(state[n + STATE_MU], np.float32)).to(device)
        rho = torch.from_numpy(np.asarray(state[n + STATE_RHO], np.float32)).to(device)
        out[n] = (mu, F.softplus(rho))
    return out


def posterior_of(model: nn.Module) -> Prior:
    """The model's current posterior (mu, sigma) per Gaussian, detached copies."""
    return {n: (layer.mu(local).detach().clone(), layer.sigma(local).detach().clone())
            for n, layer, local in gaussians(model)}


def kl_to(model: nn.Module, prior: Prior) -> Tensor:
    """Closed-form KL( q || prior ) summed over every Gaussian of `model`."""
    terms = [kl_normal(layer.mu(local), layer.sigma(local), *prior[n]).sum()
             for n, layer, local in gaussians(model)]
    return torch.stack(terms).sum()


class BayesHooks(MethodHooks):
    """Bayes by Backprop against the last global posterior (see the module docstring)."""

    def __init__(self, learn: LearnConfig) -> None:
        self.learn = learn
        self.global_prior: Prior = {}
        self.snn = False
        self.n_weights = 0
        self.fed: FedConfig | None = None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return to_bayesian(model, self.learn.bayes_sigma)

    def attach(self, client: ClientView) -> None:
        self.fed = client.fed
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=client.gen))
        set_generator(client.model, torch.Generator(client.device).manual_seed(seed))
        self.names = [n for n, _, _ in gaussians(client.model)]
        if not self.names:
            raise ConfigError("Bayesian objectives need a model with Linear or Conv2d layers")
        self.n_weights = sum(layer.mu(local).numel() for _, layer, local in
                             gaussians(client.model))
        self._on_version(client)

    def _on_version(self, client: ClientView) -> None:
        fed = self.fed
        assert fed is not None
        self.global_prior = prior_from_state(client.base, self.names, client.device)
        product = get_rule(fed).multiplies_likelihoods
        self.snn = product and client.version < fed.bnn_init_rounds
        set_mode(client.model, "mean" if self.snn else "auto")
        if isinstance(client.encoder, GaussianEncoder):
            client.encoder.likelihood = product and not self.snn

    def on_global(self, client: ClientView, g: GlobalModel) -> None:
        self._on_version(client)

    def scale(self, client: ClientView) -> float:
        """The normaliser N of the prior term."""
        if self.learn.kl_scale == "params":
            return float(self.n_weights)
        step = max((layer.last_batch for _, layer, _ in gaussians(client.model)), default=0)
        return float(max(client.samples_in_task + step, 1))

    def prior_term(self, client: ClientView) -> Tensor:
        """KL( q || N(global) ), closed form."""
        return kl_to(client.model, self.global_prior)

    def penalty(self, client: ClientView) -> Tensor | None:
        """lambda_p * (prior term + the Gaussian prototype rows' KL to their prior) / N."""
        if self.snn or self.learn.lambda_p == 0:
            return None
        term = self.prior_term(client)
        rows = client.protos.row_kl() if client.protos is not None else None
        if rows is not None:
            term = term + rows
        return self.learn.lambda_p * term / self.scale(client)


class VFCLHooks(BayesHooks):
    """VFCL: mixture prior of the global posterior and the client's own history."""

    def __init__(self, learn: LearnConfig) -> None:
        super().__init__(learn)
        self.history: Prior | None = None

    def on_task_start(self, client: ClientView, task: int) -> None:
        if client.batches > 0:  # the posterior at the end of the previous task
            self.history = posterior_of(client.model)

    def prior_term(self, client: ClientView) -> Tensor:
        if self.history is None or self.learn.lambda_k >= 1.0:
            return super().prior_term(client)
        n = self.learn.vfcl_samples
        lam = self.learn.lambda_k
        terms = []
        for name, layer, local in gaussians(client.model):
            mu, sigma = layer.mu(local), layer.sigma(local)
            first = layer.last_sample.get(local)
            draws = [first if first is not None else layer.draw(local)]
            draws += [layer.draw(local) for _ in range(n - 1)]
            for w in draws:
                log_q = normal_log_prob(w, mu, sigma)
                log_p = mixture_log_prob(w, lam, self.global_prior[name], self.history[name])
                terms.append((log_q - log_p).sum())
        return torch.stack(terms).sum() / n


class FedBNNHooks(BayesHooks):
    """FedBNN: prior = last global posterior; sends its likelihood with the fedbnn aggregation;
    optional standard-network start (`bnn_init_rounds`)."""


def client_hooks(method: str, learn: LearnConfig, fed: FedConfig) -> MethodHooks:
    """The hooks of a client: the method's own, or Bayes by Backprop against the last global
    for a method without Bayesian hooks that runs with the gaussian encoding."""
    if get_method(method).encoding == fed.encoding or not get_encoding(fed.encoding).bayesian:
        return make_hooks(method, learn)
    return BayesHooks(learn)
