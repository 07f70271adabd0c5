"""Gaussian updates: wire names, validation, conflation, FedBNN product, moment matching,
mixing, and the gaussian runs' configuration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgefcl.config import ConfigError, FedConfig, RunConfig, apply, parse_entry, run_entries
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.gaussian import (
    LIK_FLOOR,
    LIK_SIGMA_MAX,
    SIGMA_MIN,
    Conflation,
    FedBNNProduct,
    GaussianEncoder,
    MomentMatching,
    check_gaussian,
    from_wire,
    likelihood,
    mix_gaussian,
    softplus,
    softplus_inv,
    to_wire,
)
from edgefcl.federation.messages import Update
from edgefcl.transport.codec import decode, encode

f32 = np.float32


def wire(mu, sigma, plain=None) -> dict[str, np.ndarray]:
    out = {"w::mu": np.asarray(mu, f32), "w::sigma": np.asarray(sigma, f32)}
    if plain is not None:
        out["bn.running_mean"] = np.asarray(plain, f32)
    return out


def upd(tensors, n=10, client="a", base_version=0) -> Update:
    return Update(client, base_version, 1, 0, 4, n, tensors, "gaussian")


def state(mu, sigma) -> dict[str, np.ndarray]:
    """Model state of one Gaussian tensor `w` (w_mu, w_rho)."""
    return {"w_mu": np.asarray(mu, f32),
            "w_rho": softplus_inv(np.asarray(sigma, np.float64)).astype(f32)}


# -- wire form ---------------------------------------------------------------------------------
def test_to_wire_and_back() -> None:
    s = {"l.weight_mu": np.array([0.5, -1.0], f32), "l.weight_rho": np.array([-3.0, 2.0], f32),
         "bn.running_var": np.array([2.0], f32)}
    w = to_wire(s)
    assert list(w) == ["l.weight::mu", "l.weight::sigma", "bn.running_var"]
    np.testing.assert_allclose(w["l.weight::sigma"], np.log1p(np.exp([-3.0, 2.0])), rtol=1e-6)
    back = from_wire(w)
    assert set(back) == set(s)
    np.testing.assert_allclose(back["l.weight_rho"], s["l.weight_rho"], rtol=1e-5)
    np.testing.assert_array_equal(back["l.weight_mu"], s["l.weight_mu"])


def test_softplus_inverse_is_stable() -> None:
    sigma = np.array([1e-6, 1e-3, 0.05, 1.0, 30.0])
    np.testing.assert_allclose(softplus(softplus_inv(sigma)), sigma, rtol=1e-9)


def test_tiny_sigma_is_clamped_and_survives_float16() -> None:
    w = to_wire({"w_mu": np.zeros(2, f32), "w_rho": np.array([-40.0, 0.0], f32)})
    assert w["w::sigma"][0] == pytest.approx(SIGMA_MIN)
    msg = decode(encode(upd(w), fleet="f", wire_dtype="<f2"), "f")
    assert (msg.tensors["w::sigma"] > 0).all()
    assert check_gaussian(msg.tensors, {k: v.shape for k, v in w.items()}) is None


def test_check_gaussian_rejects_bad_sigma_names_and_nonfinite() -> None:
    spec = {"w::mu": (2,), "w::sigma": (2,)}
    assert check_gaussian(wire([0, 0], [1, 1]), spec) is None
    assert check_gaussian(wire([0, 0], [1, 0]), spec) == "sigma"
    assert check_gaussian(wire([0, 0], [1, -2]), spec) == "sigma"
    assert check_gaussian(wire([0, np.nan], [1, 1]), spec) == "nonfinite"
    assert check_gaussian({"w::mu": np.zeros(2, f32)}, spec) == "names"


def test_aggregator_counts_rejected_sigma() -> None:
    fed = FedConfig(encoding="gaussian", aggregation="conflation", mode="async", min_clients=1)
    agg = Aggregator(wire([0, 0], [1, 1]), fed)
    assert agg.submit(upd(wire([0, 0], [1, 0]))) is None
    assert agg.counters["rejected_sigma"] == 1
    assert agg.global_.version == 0


# -- conflation --------------------------------------------------------------------------------
def test_conflation_of_two_gaussians_matches_closed_form() -> None:
    # N(1, 1) x N(3, 2^2): precision 1 + 1/4 = 1.25, var 0.8, mu = 0.8 (1 + 3/4) = 1.4
    s = Conflation(FedConfig(mix=1.0), {})
    s.add(upd(wire([1.0], [1.0]), n=1))
    s.add(upd(wire([3.0], [2.0]), n=1000, client="b"))  # sample counts do not matter
    out = s.result(wire([0.0], [1.0]))
    assert out["w::mu"][0] == pytest.approx(1.4, rel=1e-6)
    assert out["w::sigma"][0] == pytest.approx(np.sqrt(0.8), rel=1e-6)


def test_mixing_with_previous_global_on_both_moments() -> None:
    # 0.5 N(1.4, 0.8) + 0.5 N(0, 1): mu 0.7, var 0.4 + 0.5 + 0.25 * 1.4^2 = 1.39
    s = Conflation(FedConfig(mix=0.5), {})
    s.add(upd(wire([1.0], [1.0])))
    s.add(upd(wire([3.0], [2.0]), client="b"))
    out = s.result(wire([0.0], [1.0]))
    assert out["w::mu"][0] == pytest.approx(0.7, rel=1e-6)
    assert out["w::sigma"][0] == pytest.approx(np.sqrt(1.39), rel=1e-6)
    mu, sd = mix_gaussian(np.array([2.0]), np.array([1.0]), np.array([2.0]), np.array([1.0]), 0.3)
    assert (mu[0], sd[0]) == pytest.approx((2.0, 1.0))


def test_plain_tensors_are_averaged_by_samples() -> None:
    s = Conflation(FedConfig(mix=1.0), {})
    s.add(upd(wire([0.0], [1.0], plain=[1.0]), n=1))
    s.add(upd(wire([0.0], [1.0], plain=[5.0]), n=3, client="b"))
    assert s.result(wire([0.0], [1.0], plain=[0.0]))["bn.running_mean"][0] == pytest.approx(4.0)


# -- FedBNN ------------------------------------------------------------------------------------
def test_likelihood_division_closed_form() -> None:
    # posterior N(1, 0.5^2) / prior N(0, 1): lambda = 4 - 1 = 3, m = (4 * 1 - 0) / 3
    m, s, invalid = likelihood(np.array([1.0]), np.array([0.5]), np.array([0.0]), np.array([1.0]))
    assert not invalid[0]
    assert m[0] == pytest.approx(4 / 3)
    assert s[0] == pytest.approx(1 / np.sqrt(3))
    # wider than the prior: no usable precision, sent at the floor with the posterior mean
    m, s, invalid = likelihood(np.array([0.3]), np.array([2.0]), np.array([0.0]), np.array([1.0]))
    assert invalid[0] and s[0] == LIK_SIGMA_MAX and m[0] == pytest.approx(0.3)


def test_fedbnn_product_of_prior_and_likelihoods() -> None:
    # prior N(0, 1); client 1 posterior N(1, 1/4) -> lik (4/3, 1/3); client 2 N(-1, 1/2) ->
    # lik (-2, 1). Product: precision 1 + 3 + 1 = 5, mu = (0 + 4 - 2) / 5 = 0.4.
    prior = state([0.0], [1.0])
    enc = GaussianEncoder(likelihood=True)
    s = FedBNNProduct(FedConfig(mix=1.0), {})
    s.add(upd(enc.encode(state([1.0], [0.5]), prior)))
    s.add(upd(enc.encode(state([-1.0], [np.sqrt(0.5)]), prior), client="b"))
    out = s.result(to_wire(prior))
    assert out["w::mu"][0] == pytest.approx(0.4, rel=1e-5)
    assert out["w::sigma"][0] == pytest.approx(np.sqrt(0.2), rel=1e-5)
    assert s.counters()["fedbnn_clamped"] == 0 and enc.clamped == 0


def test_fedbnn_gives_back_the_prior_when_clients_learned_nothing() -> None:
    mu, sd = np.array([0.3, -1.2, 2.0], f32), np.array([0.05, 0.2, 1.0], f32)
    prior = state(mu, sd)
    enc = GaussianEncoder(likelihood=True)
    s = FedBNNProduct(FedConfig(mix=1.0), {})
    for c in "abc":
        s.add(upd(enc.encode(prior, prior), client=c))
    out = s.result(to_wire(prior))
    # three likelihoods clamped to the floor precision: the prior up to 3 * LIK_FLOOR
    np.testing.assert_allclose(out["w::mu"], mu, rtol=1e-5)
    np.testing.assert_allclose(out["w::sigma"], to_wire(prior)["w::sigma"], rtol=1e-5)
    assert s.counters()["fedbnn_clamped"] == 9 == enc.clamped
    assert LIK_FLOOR * 3 < 1e-5


def test_fedbnn_standard_network_phase_averages() -> None:
    s = FedBNNProduct(FedConfig(encoding="gaussian", aggregation="fedbnn", bnn_init_rounds=2,
                                mix=1.0), {})
    s.add(upd(wire([1.0], [0.05]), n=1, base_version=1))
    s.add(upd(wire([3.0], [0.05]), n=3, base_version=1, client="b"))
    out = s.result(wire([0.0], [0.05]))
    assert out["w::mu"][0] == pytest.approx(2.5)
    assert out["w::sigma"][0] == pytest.approx(0.05)


# -- moment matching ---------------------------------------------------------------------------
def test_moment_matching_of_identical_inputs_is_the_identity() -> None:
    rng = np.random.default_rng(0)
    mu = rng.normal(size=50).astype(f32)
    sd = rng.uniform(1e-4, 1.0, size=50).astype(f32)
    s = MomentMatching(FedConfig(mix=0.5), {})
    for c, n in zip("abc", (1, 7, 30), strict=True):
        s.add(upd(wire(mu, sd), n=n, client=c))
    out = s.result(wire(mu, sd))
    np.testing.assert_allclose(out["w::mu"], mu, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["w::sigma"], sd, rtol=1e-6)


def test_moment_matching_weights_by_samples() -> None:
    # weights 1/4, 3/4; mu 0 and 2, sigma 1: mu 1.5, var 0.25 * 1 + 0.75 * 5 - 2.25 = 1.75
    s = MomentMatching(FedConfig(mix=1.0), {})
    s.add(upd(wire([0.0], [1.0]), n=1))
    s.add(upd(wire([2.0], [1.0]), n=3, client="b"))
    out = s.result(wire([0.0], [1.0]))
    assert out["w::mu"][0] == pytest.approx(1.5)
    assert out["w::sigma"][0] == pytest.approx(np.sqrt(1.75), rel=1e-6)


@pytest.mark.parametrize("max_share,mu", [(1.0, 1.4), (0.0, 2.0)])
def test_aggregator_round_with_gaussian_updates(max_share, mu) -> None:
    # precisions 1 and 1/4: conflation gives (1 + 3/4) / (5/4) = 1.4; with the default share
    # cap two updates hold an equal share of the precision (a's sigma raised to 2): mean 2
    fed = FedConfig(clients=2, encoding="gaussian", aggregation="conflation", mix=1.0,
                    max_share=max_share)
    agg = Aggregator(wire([0.0], [1.0]), fed)
    agg.join("a")
    agg.join("b")
    agg.submit(upd(wire([1.0], [1.0])))
    closed = agg.submit(upd(wire([3.0], [2.0]), client="b"))
    assert closed is not None and closed.global_.version == 1
    assert closed.global_.tensors["w::mu"][0] == pytest.approx(mu, rel=1e-6)


# -- configuration -----------------------------------------------------------------------------
def test_parse_compare_entries() -> None:
    assert parse_entry("bi+gaussian/conflation") == ("bi", "gaussian", "conflation")
    assert parse_entry("bi+gaussian") == ("bi", "gaussian", None)
    assert parse_entry("vfcl") == ("vfcl", None, None)
    with pytest.raises(ConfigError):
        parse_entry("bi+")


def test_run_entries_resolve_encodings() -> None:
    cfg = apply(RunConfig(), {"compare": "bi,bi+gaussian/moments,fedbnn,vfcl,bi+gaussian"})
    got = [(label, m, f.encoding, f.aggregation) for label, m, f in run_entries(cfg)]
    assert got == [("bi", "bi", "dense", "fedavg"),
                   ("bi+gaussian/moments", "bi", "gaussian", "moments"),
                   ("fedbnn", "fedbnn", "gaussian", "fedbnn"),
                   ("vfcl", "vfcl", "gaussian", "conflation"),
                   ("bi+gaussian", "bi", "gaussian", "conflation")]
    single = apply(RunConfig(), {"learn": {"method": "vfcl"}})
    assert (single.fed.encoding, single.fed.aggregation) == ("gaussian", "conflation")


@pytest.mark.parametrize("values", [
    {"compare": "bi+gaussian/fedavg"},
    {"compare": "bi+dense/conflation"},
    {"compare": "vfcl+dense"},
    {"learn": {"score_source": "posterior"}},
    {"learn": {"method": "vfcl", "lambda_k": 1.5}},
])
def test_bad_gaussian_configs_are_rejected(values) -> None:
    with pytest.raises(ConfigError):
        apply(RunConfig(), values)


def test_gaussian_payload_is_about_twice_dense() -> None:
    dense = {"w": np.zeros((64, 64), f32), "bn.running_mean": np.zeros(64, f32)}
    st = {"w_mu": dense["w"], "w_rho": dense["w"], "bn.running_mean": dense["bn.running_mean"]}
    g = GaussianEncoder().encode(st, st)
    nd = len(encode(dataclasses.replace(upd(dense), encoding="dense"), fleet="f"))
    ng = len(encode(upd(g), fleet="f"))
    assert 1.9 < ng / nd < 2.0
