"""Gaussian updates: mean and sigma of every Bayesian weight on the wire, and the three ways to
aggregate them (docs/algorithms.md §3-4).

Wire names: the Gaussian of weight tensor `W` travels as `W::mu` and `W::sigma` (sigma > 0);
every other federated tensor (BatchNorm affine parameters and statistics) travels as it is and
is averaged like a dense update (weighted by samples). The model state keeps `W_mu` and `W_rho`
(sigma = softplus(rho)); `to_wire` / `from_wire` convert.

Strategies (the `rules` of the `GAUSSIAN` encoding descriptor):
- `conflation` (VFCL Eq. 11): precision-weighted product of the client posteriors;
- `fedbnn`: the previous global (the clients' prior) times the clients' likelihoods (the
  client sends posterior / prior), likelihood precisions at or below LIK_FLOOR are clamped to
  it and counted (`fedbnn_clamped` in the aggregator counters); updates sent during the first
  `bnn_init_rounds` rounds (standard-network phase) are averaged like FedAvg;
- `moments`: sample-weighted moment matching, mu = sum w mu_k,
  sigma^2 = sum w (mu_k^2 + sigma_k^2) - mu^2.
The new global is mixed with the previous one on both moments (moment matching of the mixture
mix * new + (1 - mix) * previous).
"""

from __future__ import annotations

import numpy as np

from edgefcl.federation.encodings import Encoding
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.sigma_bounds import LIK_FLOOR, LIK_SIGMA_MAX
from edgefcl.federation.strategy import (
    Spec,
    Strategy,
    WeightedSum,
    check_dense,
    entry_scaled,
    entry_weights,
    merge_weighted_sum,
    mix,
    sample_weight,
    scalar_factor,
    scaled_sum,
)

MU, SIGMA = "::mu", "::sigma"
STATE_MU, STATE_RHO = "_mu", "_rho"
SIGMA_MIN = 1e-5
"""Smallest sigma sent or published (still positive after a float16 wire)."""
LIK_REL_FLOOR = 1e-3
"""A client likelihood precision below this fraction of its prior's is treated as invalid."""


# -- names and conversions ----------------------------------------------------------------------
def gaussian_bases(names) -> list[str]:
    """Weight tensor names W that have both `W::mu` and `W::sigma` among `names`."""
    names = set(names)
    return [n[: -len(MU)] for n in names if n.endswith(MU) and n[: -len(MU)] + SIGMA in names]


def split_wire(tensors: Tensors) -> tuple[list[str], list[str]]:
    """(Gaussian bases, plain tensor names) of a wire payload, in a stable order."""
    bases = sorted(gaussian_bases(tensors))
    paired = {b + MU for b in bases} | {b + SIGMA for b in bases}
    return bases, [k for k in tensors if k not in paired]


def softplus(rho: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, rho.astype(np.float64))


def softplus_inv(sigma: np.ndarray) -> np.ndarray:
    s = sigma.astype(np.float64)
    with np.errstate(over="ignore"):
        return np.where(s > 20.0, s, s + np.log(-np.expm1(-np.minimum(s, 20.0))))


def to_wire(state: Tensors) -> Tensors:
    """Model state (W_mu, W_rho, plain tensors) -> wire (W::mu, W::sigma, plain), float32,
    sigma clamped to SIGMA_MIN."""
    out: Tensors = {}
    for k, v in state.items():
        if k.endswith(STATE_MU) and k[: -len(STATE_MU)] + STATE_RHO in state:
            base = k[: -len(STATE_MU)]
            out[base + MU] = np.asarray(v, np.float32)
            sigma = softplus(state[base + STATE_RHO])
            out[base + SIGMA] = np.maximum(sigma, SIGMA_MIN).astype(np.float32)
        elif k.endswith(STATE_RHO) and k[: -len(STATE_RHO)] + STATE_MU in state:
            continue
        else:
            out[k] = np.asarray(v, np.float32)
    return out


def from_wire(tensors: Tensors) -> Tensors:
    """Wire (W::mu, W::sigma, plain) -> model state (W_mu, W_rho = softplus^-1(sigma), plain)."""
    out: Tensors = {}
    for k, v in tensors.items():
        if k.endswith(MU):
            out[k[: -len(MU)] + STATE_MU] = np.asarray(v, np.float32)
        elif k.endswith(SIGMA):
            out[k[: -len(SIGMA)] + STATE_RHO] = softplus_inv(np.asarray(v)).astype(np.float32)
        else:
            out[k] = np.asarray(v, np.float32)
    return out


# -- Gaussian algebra (float64) --------------------------------------------------------------
def likelihood(mu_q: np.ndarray, s_q: np.ndarray, mu_p: np.ndarray, s_p: np.ndarray,
               rel_floor: float = LIK_REL_FLOOR) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Posterior N(mu_q, s_q^2) divided by prior N(mu_p, s_p^2): (m, sigma, invalid).

    lambda = 1/s_q^2 - 1/s_p^2, m = (mu_q/s_q^2 - mu_p/s_p^2) / lambda. Entries with
    lambda <= rel_floor / s_p^2 (the posterior did not get narrower than the prior: no usable
    information) are `invalid`: sent as sigma = LIK_SIGMA_MAX, m = mu_q.
    """
    pq, pp = 1.0 / np.square(s_q, dtype=np.float64), 1.0 / np.square(s_p, dtype=np.float64)
    lam = pq - pp
    invalid = lam <= rel_floor * pp
    safe = np.where(invalid, 1.0, lam)
    m = np.where(invalid, mu_q, (mu_q * pq - mu_p * pp) / safe)
    sigma = np.where(invalid, LIK_SIGMA_MAX, 1.0 / np.sqrt(safe))
    return m, sigma, invalid


def mix_gaussian(mu_new: np.ndarray, s_new: np.ndarray, mu_prev: np.ndarray, s_prev: np.ndarray,
                 weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Moment-matched mixture weight * N(new) + (1 - weight) * N(prev):
    mu = w mu_new + (1-w) mu_prev, var = w s_new^2 + (1-w) s_prev^2 + w (1-w) (mu_new-mu_prev)^2."""
    mu_new, mu_prev = np.asarray(mu_new, np.float64), np.asarray(mu_prev, np.float64)
    mu = weight * mu_new + (1.0 - weight) * mu_prev
    var = (weight * np.square(s_new, dtype=np.float64)
           + (1.0 - weight) * np.square(s_prev, dtype=np.float64)
           + weight * (1.0 - weight) * np.square(mu_new - mu_prev))
    return mu, np.sqrt(var)


# -- validation ------------------------------------------------------------------------------
def check_gaussian(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject a gaussian payload: dense checks (names, shapes, float32, finite) plus
    sigma > 0 for every `::sigma` tensor."""
    reason = check_dense(tensors, spec)
    if reason is not None:
        return reason
    for k, t in tensors.items():
        if k.endswith(SIGMA) and not (t > 0).all():
            return "sigma"
    return None


# -- strategies ------------------------------------------------------------------------------
class GaussianStrategy(Strategy):
    """Common part: plain tensors averaged by samples, Gaussians per subclass, mixing on both
    moments with the previous global."""

    def reset(self) -> None:
        self.plain = WeightedSum()

    def add(self, update: Update) -> None:
        bases, plain = split_wire(update.tensors)
        if plain:
            self.plain.add({k: update.tensors[k] for k in plain}, sample_weight(update))
        self._add_gaussians(update, bases)

    def _add_gaussians(self, update: Update, bases: list[str]) -> None:
        raise NotImplementedError

    def _gaussians(self, previous: Tensors, bases: list[str]) -> dict[str, tuple]:
        """New (mu, sigma) per base before mixing."""
        raise NotImplementedError

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray], None]:
        """New mu and sigma per base (`W::mu`, `W::sigma`) and averaged plain tensors."""
        bases, plain = split_wire(previous)
        new = {}
        for b, (mu, s) in self._gaussians(previous, bases).items():
            new[b + MU], new[b + SIGMA] = mu, s
        if plain:
            avg = self.plain.mean()
            new.update({k: avg[k] for k in plain})
        return new, None

    def mix(self, new: dict[str, np.ndarray], previous: Tensors,
            sent: dict[str, np.ndarray] | None) -> Tensors:
        """Moment-matched mixture on the Gaussians, linear on the plain tensors."""
        bases, plain = split_wire(previous)
        out = mix({k: new[k] for k in plain}, {k: previous[k] for k in plain}, self.mix_weight)
        for b in bases:
            mu, s = mix_gaussian(new[b + MU], new[b + SIGMA], previous[b + MU],
                                 previous[b + SIGMA], self.mix_weight)
            out[b + MU] = mu.astype(np.float32)
            out[b + SIGMA] = np.maximum(s, SIGMA_MIN).astype(np.float32)
        return {k: out[k] for k in previous}


class _PrecisionSums:
    """Running sums of precision and precision * mean per base (float64)."""

    def __init__(self) -> None:
        self.prec: dict[str, np.ndarray] = {}
        self.eta: dict[str, np.ndarray] = {}
        self.count = 0

    def add(self, base: str, mu: np.ndarray, prec: np.ndarray) -> None:
        mu = np.asarray(mu, np.float64)
        if base not in self.prec:
            self.prec[base], self.eta[base] = np.zeros_like(mu), np.zeros_like(mu)
        self.prec[base] += prec
        self.eta[base] += prec * mu


class Conflation(GaussianStrategy):
    """VFCL Eq. 11: 1/sigma^2 = sum_c 1/sigma_c^2, mu = sigma^2 sum_c mu_c / sigma_c^2
    (every client counts once, whatever its sample count)."""

    decomposable = True

    def reset(self) -> None:
        super().reset()
        self.sums = _PrecisionSums()

    def _add_gaussians(self, update: Update, bases: list[str]) -> None:
        for b in bases:
            s = update.tensors[b + SIGMA].astype(np.float64)
            self.sums.add(b, update.tensors[b + MU], 1.0 / np.square(s))
        self.sums.count += 1

    def _gaussians(self, previous: Tensors, bases: list[str]) -> dict[str, tuple]:
        if self.sums.count == 0:
            raise ValueError("no contributions to aggregate")
        return {b: (self.sums.eta[b] / self.sums.prec[b], 1.0 / np.sqrt(self.sums.prec[b]))
                for b in bases}

    def partial(self) -> dict:
        """Plain tensors' weighted sums, and per base the precision and precision * mean
        sums with the number of clients."""
        return {"plain": {"weight": self.plain.weight, "sums": dict(self.plain.sums or {})},
                "prec": dict(self.sums.prec), "eta": dict(self.sums.eta),
                "count": self.sums.count, **self.fresh_partial()}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`."""
        merge_weighted_sum(self.plain, partial["plain"])
        self.merge_fresh(partial)
        for b in sorted(partial["prec"]):
            prec = np.asarray(partial["prec"][b], np.float64)
            if b not in self.sums.prec:
                self.sums.prec[b], self.sums.eta[b] = np.zeros_like(prec), np.zeros_like(prec)
            self.sums.prec[b] += prec
            self.sums.eta[b] += np.asarray(partial["eta"][b], np.float64)
        self.sums.count += int(partial["count"])

    def partial_weights(self, partial: dict) -> dict[str, np.ndarray]:
        """Its updates' precision, entry by entry (as the precision cap weighs them), and
        the sample weight of its plain tensors."""
        return {"plain": np.array([float(partial["plain"].get("weight", 0.0))]),
                **entry_weights("prec", partial["prec"])}

    def scale_partial(self, partial: dict, factors: dict[str, np.ndarray]) -> dict:
        return {**partial, "plain": scaled_sum(partial["plain"],
                                                   scalar_factor(factors, "plain")),
                "prec": entry_scaled("prec", partial["prec"], factors),
                "eta": entry_scaled("prec", partial["eta"], factors)}


class MomentMatching(GaussianStrategy):
    """Sample-weighted moment matching of the client posteriors (FedBNN's reference code):
    mu = sum_k w_k mu_k, sigma^2 = sum_k w_k (mu_k^2 + sigma_k^2) - mu^2, w_k = n_k / sum n."""

    decomposable = True
    adds_variances = True

    def reset(self) -> None:
        super().reset()
        self.first = WeightedSum()
        self.second = WeightedSum()
        self.origin: dict[str, np.ndarray] = {}
        """Second moments are taken about the first client's means (shifted sums keep the
        variance of the means free of cancellation)."""

    def _add_gaussians(self, update: Update, bases: list[str]) -> None:
        w = sample_weight(update)
        mus = {b: update.tensors[b + MU].astype(np.float64) for b in bases}
        for b in bases:
            self.origin.setdefault(b, mus[b])
        self.first.add(mus, w)
        self.second.add({b: np.square(update.tensors[b + SIGMA].astype(np.float64))
                         + np.square(mus[b] - self.origin[b]) for b in bases}, w)

    def _gaussians(self, previous: Tensors, bases: list[str]) -> dict[str, tuple]:
        mean, second = self.first.mean(), self.second.mean()
        return {b: (mean[b], np.sqrt(np.maximum(second[b] - np.square(mean[b] - self.origin[b]),
                                                0.0))) for b in bases}

    def partial(self) -> dict:
        """Plain tensors' weighted sums, the weighted sums of means and of second moments
        (about `origin`), and the origin of each base."""
        return {"plain": {"weight": self.plain.weight, "sums": dict(self.plain.sums or {})},
                "first": {"weight": self.first.weight, "sums": dict(self.first.sums or {})},
                "second": {"weight": self.second.weight, "sums": dict(self.second.sums or {})},
                "origin": dict(self.origin), **self.fresh_partial()}

    def merge(self, partial: dict) -> None:
        """Add another shard's `partial()`; its second moments are moved to this instance's
        origins: sum w (x - o)^2 = sum w (x - o')^2 + 2 (o' - o) (sum w x - W o') + W (o' - o)^2."""
        merge_weighted_sum(self.plain, partial["plain"])
        self.merge_fresh(partial)
        first, second = partial["first"], partial["second"]
        if not first["sums"]:
            return
        w = float(first["weight"])
        shifted = {}
        for b in sorted(first["sums"]):
            theirs = np.asarray(partial["origin"][b], np.float64)
            ours = self.origin.setdefault(b, theirs)
            d = theirs - ours
            s1 = np.asarray(first["sums"][b], np.float64)
            shifted[b] = (np.asarray(second["sums"][b], np.float64)
                          + 2.0 * d * (s1 - w * theirs) + w * np.square(d))
        merge_weighted_sum(self.first, first)
        merge_weighted_sum(self.second, {"weight": second["weight"], "sums": shifted})

    def partial_weights(self, partial: dict) -> dict[str, np.ndarray]:
        """Its updates' sample weight."""
        return {"weight": np.array([float(partial["first"]["weight"])])}

    def scale_partial(self, partial: dict, factors: dict[str, np.ndarray]) -> dict:
        f = scalar_factor(factors, "weight")
        return {**partial, "plain": scaled_sum(partial["plain"], f),
                "first": scaled_sum(partial["first"], f),
                "second": scaled_sum(partial["second"], f)}


class FedBNNProduct(GaussianStrategy):
    """FedBNN Eq. 9: the previous global (the prior the clients trained against) times every
    client likelihood: 1/s^2 = 1/s_prior^2 + sum_k lambda_k,
    mu = s^2 (mu_prior/s_prior^2 + sum_k lambda_k m_k). Likelihood precisions at or below
    LIK_FLOOR (clients send sigma = LIK_SIGMA_MAX for entries whose posterior did not narrow)
    are clamped to the floor and counted. Updates based on a global of version <
    `bnn_init_rounds` come from the standard-network phase and are averaged (FedAvg of mu and
    sigma); they are ignored for the Gaussians of a round that also has Bayesian updates."""

    multiplies_likelihoods = True

    def reset(self) -> None:
        super().reset()
        self.sums = _PrecisionSums()
        self.snn = WeightedSum()

    def _add_gaussians(self, update: Update, bases: list[str]) -> None:
        if update.base_version < self.fed.bnn_init_rounds:
            self.snn.add({k: update.tensors[k] for b in bases for k in (b + MU, b + SIGMA)},
                         sample_weight(update))
            return
        for b in bases:
            s = update.tensors[b + SIGMA].astype(np.float64)
            lam = 1.0 / np.square(s)
            low = lam <= LIK_FLOOR * (1 + 1e-6)
            self.counts["fedbnn_clamped"] += int(low.sum())
            self.counts["fedbnn_entries"] += int(lam.size)
            self.sums.add(b, update.tensors[b + MU], np.maximum(lam, LIK_FLOOR))
        self.sums.count += 1

    def _gaussians(self, previous: Tensors, bases: list[str]) -> dict[str, tuple]:
        if self.sums.count == 0:
            snn = self.snn.mean()
            return {b: (snn[b + MU], snn[b + SIGMA]) for b in bases}
        if self.snn.weight > 0:
            self.counts["fedbnn_snn_ignored"] += 1
        out = {}
        for b in bases:
            p_prior = 1.0 / np.square(previous[b + SIGMA].astype(np.float64))
            prec = p_prior + self.sums.prec[b]
            eta = p_prior * previous[b + MU].astype(np.float64) + self.sums.eta[b]
            out[b] = (eta / prec, 1.0 / np.sqrt(prec))
        return out


# -- client side -----------------------------------------------------------------------------
class GaussianEncoder:
    """Client encoder of the gaussian encoding: the posterior (W::mu, W::sigma, plain tensors),
    or with `likelihood` (FedBNN aggregation) the posterior divided by the prior `base` (the
    last global merged); `clamped` / `entries` count the likelihood entries sent as invalid."""

    name = "gaussian"

    def __init__(self, likelihood: bool = False) -> None:
        self.likelihood = likelihood
        self.clamped = 0
        self.entries = 0

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        post = to_wire(current)
        if not self.likelihood:
            return post
        prior = to_wire(base)
        out = dict(post)
        for b in gaussian_bases(post):
            m, s, invalid = likelihood(post[b + MU], post[b + SIGMA], prior[b + MU],
                                       prior[b + SIGMA])
            out[b + MU], out[b + SIGMA] = m.astype(np.float32), s.astype(np.float32)
            self.clamped += int(invalid.sum())
            self.entries += int(invalid.size)
        return out

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        return from_wire(tensors)


GAUSSIAN = Encoding(
    name="gaussian",
    help="mu and sigma of Bayesian layers (the model is converted to a Bayesian one)",
    make_encoder=lambda fed: GaussianEncoder(),
    validate=check_gaussian,
    rules={"conflation": Conflation, "fedbnn": FedBNNProduct, "moments": MomentMatching},
    form="gaussian",
    initial=to_wire,
    sparse_downlink=False,
    bayesian=True,
    default_rule="conflation",
)
