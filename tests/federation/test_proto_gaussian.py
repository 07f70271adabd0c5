"""Gaussian prototype rows (encoding gaussian, head prototypes): the library's mean and rho
rows, sampled training and prediction, sigmas on the wire, in the store and at the device, and
the aggregator's per-label Gaussian rule (conflation with the sigma floor and the share cap)."""

from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
import pytest
import torch

from edgefcl.build import new_client
from edgefcl.config import FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.global_check import check_global
from edgefcl.federation.label_rows import (
    LabelRows,
    check_rows,
    rows_arrays,
    rows_digest,
    split_rows,
)
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.prototype_library import average_tables
from edgefcl.learn.bayes import predict_logits
from edgefcl.learn.merges import MERGES
from edgefcl.learn.models import build_model
from edgefcl.learn.params import get_tensors
from edgefcl.learn.proto_net import PrototypeLibrary, proto_model
from edgefcl.transport.codec import CodecError, decode, encode


def gtable(labels, mu, sigma, counts):
    mu = np.asarray(mu, np.float32).reshape(len(labels), -1)
    sigma = np.asarray(sigma, np.float32).reshape(mu.shape)
    return LabelRows(tuple(labels), mu, np.asarray(counts, np.int64), sigma)


# -- the aggregator's rule, by hand ----------------------------------------------------------
def test_two_devices_conflate_a_label_row_by_hand():
    # A: mu (1, 0), sigma (1, 1); B: mu (3, 2), sigma (1, 0.5); equal counts: plain conflation
    # precision (1 + 1, 1 + 4) = (2, 5); mu = (4 / 2, (0 + 2 * 4) / 5) = (2, 1.6)
    a = gtable(["x"], [1, 0], [1, 1], [10])
    b = gtable(["x"], [3, 2], [1, 0.5], [10])
    empty = LabelRows.empty(2, gaussian=True)
    out = average_tables([a, b], empty, 0.5, max_share=1.0, sigma_floor=0.5)
    np.testing.assert_allclose(out.rows[0], [2.0, 1.6], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(2), 1 / math.sqrt(5)], rtol=1e-6)
    assert out.counts.tolist() == [20]
    # counts 30 : 10 scale the precisions by 2 * 30/40 = 1.5 and 0.5:
    # precision (1.5 + 0.5, 1.5 + 2) = (2, 3.5); mu = ((1.5 + 1.5) / 2, 4 / 3.5)
    b30 = gtable(["x"], [1, 0], [1, 1], [30])
    out = average_tables([b30, b], empty, 0.5, max_share=1.0)
    np.testing.assert_allclose(out.rows[0], [1.5, 4 / 3.5], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(2), 1 / math.sqrt(3.5)],
                               rtol=1e-6)
    # mixed 0.5 : 0.5 with a previous row N((0, 0), (1, 1)) (moment matching):
    # mu = (1, 0.8); var = 0.5 * (0.5, 0.2) + 0.5 * 1 + 0.25 * (2, 1.6)^2 = (1.75, 1.24)
    prev = gtable(["x"], [0, 0], [1, 1], [4])
    out = average_tables([a, b], prev, 0.5, max_share=1.0)
    np.testing.assert_allclose(out.rows[0], [1.0, 0.8], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], np.sqrt([1.75, 1.24]), rtol=1e-6)
    assert out.counts.tolist() == [24]


def test_the_share_cap_bounds_a_devices_sample_weight_in_the_precision():
    # three devices, equal sigma 1; the third claims 1,000 samples against 10 and 10:
    # the cap 1/2 gives it 20 of 40 (test_prototypes' water-filling), so r = 3 * (10, 10, 20)
    # / 40 = (0.75, 0.75, 1.5) and mu = (0 + 0 + 1.5 * 9) / 3 = 4.5 (uncapped: 9 * 2.94 / 3
    # = 8.82)
    sent = [gtable(["x"], [0], [1], [10]), gtable(["x"], [0], [1], [10]),
            gtable(["x"], [9], [1], [1000])]
    empty = LabelRows.empty(1, gaussian=True)
    counters: Counter = Counter()
    out = average_tables(sent, empty, 0.5, max_share=0.0, counters=counters)
    np.testing.assert_allclose(out.rows[0], [4.5], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(3)], rtol=1e-6)
    assert counters["prototype_share_capped"] == 1
    plain = average_tables(sent, empty, 0.5, max_share=1.0)
    np.testing.assert_allclose(plain.rows[0], [9 * 3000 / 1020 / 3], rtol=1e-6)


def test_a_tiny_sigma_does_not_own_the_row():
    # attack: the third device sends sigma 1e-6 (precision 1e12) for a row at 10, two honest
    # ones sigma 1 at 0. The floor (0.5 x the median 1) raises it to 0.5, precision 4, which
    # the cap (half the entry's precision among three) lowers to 2: mu = 2 * 10 / (1 + 1 + 2)
    # = 5, sigma = 1 / sqrt(4); without them the row is the attacker's (10 to 1e-10)
    sent = [gtable(["x"], [0, 0], [1, 1], [10]), gtable(["x"], [0, 0], [1, 1], [10]),
            gtable(["x"], [10, 10], [1e-6, 1e-6], [10])]
    empty = LabelRows.empty(2, gaussian=True)
    counters: Counter = Counter()
    out = average_tables(sent, empty, 0.5, max_share=0.0, counters=counters, sigma_floor=0.5)
    np.testing.assert_allclose(out.rows[0], [5.0, 5.0], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [0.5, 0.5], rtol=1e-6)
    assert counters["prototype_sigma_floored"] == 2
    assert counters["prototype_sigma_share_capped"] == 2
    floor_only = average_tables(sent, empty, 0.5, max_share=1.0, sigma_floor=0.5)
    np.testing.assert_allclose(floor_only.rows[0], [20 / 3, 20 / 3], rtol=1e-6)  # 4 of 6
    np.testing.assert_allclose(floor_only.sigmas[0], [1 / math.sqrt(6)] * 2, rtol=1e-6)
    owned = average_tables(sent, empty, 0.5, max_share=1.0, sigma_floor=0.0)
    assert owned.rows[0, 0] > 10 - 1e-6


@pytest.mark.parametrize("fedbnn", [False, True])
def test_one_of_two_senders_cannot_own_a_row_with_a_denormal_sigma(fedbnn):
    # a reviewer helper's attack: the floor and the cap skipped labels of two senders, and a
    # sigma of 1e-45 (a denormal: > 0) took the whole row, under conflation and fedbnn alike
    sent = [gtable(["x"], [1, 1], [0.1, 0.1], [10]), gtable(["x"], [2, 2], [1e-45] * 2, [10])]
    kw = dict(likelihood=[True, True], prior_sigma=0.1) if fedbnn else {}
    counters: Counter = Counter()
    out = average_tables(sent, LabelRows.empty(2, gaussian=True), 1.0, max_share=0.0,
                         counters=counters, sigma_floor=0.5, clip_factor=3.0, **kw)
    weight = float(out.rows[0, 0]) - 1.0  # the attacker's weight on the row (prior at 0)
    assert np.isfinite(out.sigmas).all() and counters["prototype_sigma_share_capped"] == 2
    assert weight <= 0.5 + 1e-6


@pytest.mark.parametrize("fedbnn", [False, True])
def test_one_of_three_senders_cannot_blow_up_a_rows_sigma(fedbnn):
    # the diff reviewer's attack on the floor and cap: a wide sigma (1e6 under conflation,
    # 1000 as an informative likelihood) raised the honest floor and then the cap lowered
    # the honest precision to its own: with two senders the row's sigma became 7e5
    # (conflation), or the prior again (fedbnn). Of three, the ceiling (3 x the median)
    # bounds it; of two, neither sender can be told from an attacker (documented)
    wide = 1000.0 if fedbnn else 1e6
    honest = gtable(["x"], [1, 1], [0.1, 0.1], [10])
    sent = [honest, honest, gtable(["x"], [1, 1], [wide] * 2, [10])]
    kw = dict(likelihood=[True] * 3, prior_sigma=1.0) if fedbnn else {}
    out = average_tables(sent, LabelRows.empty(2, gaussian=True), 1.0, max_share=0.0,
                         sigma_floor=0.5, clip_factor=3.0, **kw)
    assert (out.sigmas <= 0.3).all(), out.sigmas


@pytest.mark.parametrize("fedbnn", [False, True])
def test_one_of_two_senders_cannot_collapse_a_rows_sigma(fedbnn):
    # the second reviewer: a ceiling of 3 x the smaller of two cut the honest sigma to 3 x
    # a tiny attacker's, and the row's sigma fell to 1e-5 (fedbnn: frozen for good)
    sent = [gtable(["x"], [1, 1], [0.1, 0.1], [10]), gtable(["x"], [5, 5], [1e-30] * 2, [10])]
    kw = dict(likelihood=[True, True], prior_sigma=1.0) if fedbnn else {}
    out = average_tables(sent, LabelRows.empty(2, gaussian=True), 1.0, max_share=0.0,
                         sigma_floor=0.5, clip_factor=3.0, **kw)
    assert (out.sigmas >= 0.05).all(), out.sigmas  # 0.1 and its equal-share partner: 0.07


def test_the_aggregator_floors_a_tiny_sigma_and_checks_the_kind():
    fed = FedConfig(clients=3, min_clients=3, burn_in=1, jump=1, clip_factor=0)
    initial = {"w": np.zeros(2, np.float32)}
    agg = Aggregator(initial, fed, prototypes=LabelRows.empty(2, gaussian=True))
    for c in ("c0", "c1", "c2"):
        agg.join(c)
    point = LabelRows(("x",), np.zeros((1, 2), np.float32), np.array([10], np.int64))
    assert agg.submit(Update("c0", 0, 1, 0, 2, 10, initial, prototypes=point)) is None
    assert agg.counters["rejected_prototype_sigma"] == 1
    closed = None
    for seq, (c, mu, s) in enumerate((("c0", 0.0, 1.0), ("c1", 0.0, 1.0),
                                      ("c2", 10.0, 1e-6)), start=2):
        u = Update(c, 0, seq, 0, 2, 10, initial, prototypes=gtable(["x"], [mu, mu], [s, s],
                                                                   [10]))
        closed = agg.submit(u) or closed
    lib = closed.global_.prototypes
    assert lib.labels == ("x",) and lib.sigmas is not None
    assert lib.rows[0, 0] <= 20 / 3 + 1e-4  # the attacker's 10 without the floor
    assert agg.counters["prototype_sigma_floored"] == 2
    dense = Aggregator(initial, fed, prototypes=LabelRows.empty(2))  # point library
    dense.join("c0")
    assert dense.submit(Update("c0", 0, 1, 0, 2, 10, initial,
                               prototypes=gtable(["x"], [0, 0], [1, 1], [1]))) is None
    assert dense.counters["rejected_prototype_sigma"] == 1


def test_the_global_library_stays_within_what_devices_accept():
    # a previous row at -1e6 mixed with a new one at +1e6, sigmas 1e5: the mixture's sigma
    # would be sqrt(1e10 + 1e12) = 1.005e6 (above MAX_VALUE, a global every device
    # refuses); it is clamped there
    prev = gtable(["x"], [-1e6], [1e5], [1])
    out = average_tables([gtable(["x"], [1e6], [1e5], [1])], prev, 0.5)
    assert check_rows(out, 1) is None and out.sigmas[0, 0] == np.float32(1e6)
    tiny = average_tables([gtable(["x"], [0.0], [1e-5], [1])] * 3,
                          LabelRows.empty(1, gaussian=True), 0.5)
    assert tiny.sigmas[0, 0] >= np.float32(1e-5)  # conflated below 1e-5: published at it


# -- validation: codec, check_rows, device, store -----------------------------------------
def test_codec_round_trips_and_bounds_sigmas():
    t = gtable(["a", "b"], np.arange(6), np.arange(1, 7), [4, 5])
    u = decode(encode(Update("c0", 0, 1, 0, 2, 10, {"w": np.zeros(2, np.float32)},
                             prototypes=t), fleet="f"))
    np.testing.assert_array_equal(u.prototypes.sigmas, t.sigmas)
    g = decode(encode(GlobalModel(3, {"w": np.zeros(2, np.float32)}, ("c0",), t), fleet="f"))
    np.testing.assert_array_equal(g.prototypes.sigmas, t.sigmas)
    for sigmas, reason in ((np.zeros((2, 3), np.float32), "sigma"),
                           (np.ones((2, 2), np.float32), "shape"),
                           (np.full((2, 3), np.nan, np.float32), "nonfinite")):
        bad = LabelRows(t.labels, t.rows, t.counts, sigmas)
        with pytest.raises(CodecError) as e:
            decode(encode(Update("c0", 0, 1, 0, 2, 10, {"w": np.zeros(2, np.float32)},
                                 prototypes=bad), fleet="f"))
        assert e.value.reason == reason


def test_check_table_bounds_sigmas():
    t = gtable(["a"], [0, 0, 0], [1, 1, 1], [1])
    assert check_rows(t, 3) is None
    for sigmas, reason in ((np.zeros((1, 3), np.float32), "sigma"),
                           (-np.ones((1, 3), np.float32), "sigma"),
                           (np.ones((1, 2), np.float32), "prototype_shape"),
                           (np.full((1, 3), np.inf, np.float32), "nonfinite"),
                           (np.full((1, 3), 2e6, np.float32), "range"),
                           (np.ones((1, 3), np.float64), "prototype_dtype")):
        assert check_rows(LabelRows(t.labels, t.rows, t.counts, sigmas), 3) == reason


def test_the_device_checks_the_librarys_kind():
    t = gtable(["a"], [0, 0, 0], [1, 1, 1], [1])
    point = LabelRows(t.labels, t.rows, t.counts)
    g = GlobalModel(1, {"w": np.zeros(2, np.float32)}, ("c0",), t)
    spec = {"w": ((2,), np.dtype(np.float32).str)}
    assert check_global(g, spec, 0, library_width=3, library_gaussian=True) is None
    assert check_global(g, spec, 0, library_width=3) == "prototype_sigma"
    gp = GlobalModel(1, g.tensors, ("c0",), point)
    assert check_global(gp, spec, 0, library_width=3, library_gaussian=True) == "prototype_sigma"
    bad = GlobalModel(1, g.tensors, ("c0",), LabelRows(t.labels, t.rows, t.counts,
                                                       np.zeros((1, 3), np.float32)))
    assert check_global(bad, spec, 0, library_width=3, library_gaussian=True) == "sigma"


def test_sigmas_are_in_the_digest_and_the_saved_arrays():
    t = gtable(["a"], [0, 0], [1, 1], [1])
    point = LabelRows(t.labels, t.rows, t.counts)
    assert rows_digest(t) != rows_digest(point)
    other = LabelRows(t.labels, t.rows, t.counts, 2 * t.sigmas)
    assert rows_digest(t) != rows_digest(other)
    rest, back = split_rows({"w": np.zeros(1, np.float32)} | rows_arrays(t))
    assert set(rest) == {"w"}
    np.testing.assert_array_equal(back.sigmas, t.sigmas)
    _, back_point = split_rows(rows_arrays(point))
    assert back_point.sigmas is None
    with pytest.raises(ValueError):
        split_rows(rows_arrays(LabelRows(t.labels, t.rows, t.counts,
                                         np.zeros((1, 2), np.float32))))


# -- the device's library ----------------------------------------------------------------------
def test_gaussian_rows_start_at_bayes_sigma_and_train_both_moments():
    lib = PrototypeLibrary(2, "adam", 0.1, sigma=0.05)
    idx, new = lib.ensure(["a", "b"])
    assert new == 2
    np.testing.assert_allclose(torch.nn.functional.softplus(lib.rho).numpy(), 0.05, rtol=1e-6)
    before = lib.rho.clone()
    lib.step(idx[:1], torch.ones(1, 3), torch.ones(1, 3))
    assert (lib.rho[0] < before[0]).all() and torch.equal(lib.rho[1], before[1])
    assert (lib.rows[0] < 0).all() and (lib.rows[1] == 0).all()
    lib.count(["a"], [3])
    t = lib.table()
    assert t.labels == ("a",) and t.sigmas.shape == (1, 3) and check_rows(t, 3) is None
    # the global's row becomes the row and its prior
    g = gtable(["a", "c"], [[1, 2, 3], [4, 5, 6]], [[0.2] * 3, [0.3] * 3], [3, 1])
    lib.merge(g)
    at = lib.index["c"]
    np.testing.assert_allclose(lib.rows[at].numpy(), [4, 5, 6])
    np.testing.assert_allclose(torch.nn.functional.softplus(lib.rho[at]).numpy(), 0.3,
                               rtol=1e-5)
    np.testing.assert_allclose(lib.prior_sigma[at].numpy(), 0.3, rtol=1e-6)
    np.testing.assert_allclose(lib.prior_mu[lib.index["a"]].numpy(), [1, 2, 3])


def gaussian_client(seed=7, eval_samples=0):
    torch.manual_seed(0)
    model = proto_model(build_model("mlp", (12,), 1, hidden=8))
    learn = LearnConfig(method="fedbnn", memory_size=20, local_epochs=2, head="prototypes",
                        eval_samples=eval_samples)
    fed = FedConfig(burn_in=1, jump=1, encoding="gaussian", aggregation="conflation")
    return new_client("c0", model, learn, fed, "vector", seed=seed)


def batches(n=12):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        t = i // 4
        y = rng.integers(2 * t, 2 * t + 2, 6)
        x = (rng.normal(size=(6, 12)) + y[:, None] * 0.5).astype(np.float32)
        out.append(Batch(x, y.astype(np.int64), t, i % 4 + 1, (i + 1) % 4 == 0))
    return out


def drive(c, bs):
    for b in bs:
        upd = c.step(b)
        if upd is not None and upd.seq % 2 == 0:
            p = upd.prototypes
            assert p.sigmas is not None and check_rows(p, p.width) is None
            shrunk = LabelRows(p.labels, 0.9 * p.rows, p.counts, 0.9 * p.sigmas)
            c.apply_global(GlobalModel(c.version + 1, {k: 0.9 * v for k, v in c.base.items()},
                                       (c.cid,), shrunk), MERGES["delta"])


def test_training_moves_the_rows_sigmas_and_a_checkpoint_restores_them_bit_for_bit():
    a = gaussian_client()
    assert a.protos.library.gaussian
    drive(a, batches()[:6])
    lib = a.protos.library
    sig = torch.nn.functional.softplus(lib.rho)
    assert not torch.allclose(sig, torch.full_like(sig, 0.05))  # rho trained (KL and draws)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = gaussian_client()
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    drive(a, batches()[6:])
    drive(b, batches()[6:])
    la, lb = a.protos.library, b.protos.library
    assert la.labels == lb.labels
    for key in ("rows", "rho", "mr", "vr", "tr", "prior_mu", "prior_sigma"):
        assert torch.equal(getattr(la, key), getattr(lb, key)), key
    ta, tb = get_tensors(a.model), get_tensors(b.model)
    assert all(np.array_equal(ta[k], tb[k]) for k in ta)


def test_prediction_uses_the_mean_rows_or_draws_them_with_the_extractor():
    c = gaussian_client()
    drive(c, batches()[:4])
    model = c.model.eval()
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(5, 12)).astype(np.float32))
    lib = model.library
    with torch.no_grad():
        mean = model(x)
        np.testing.assert_array_equal(mean.numpy(),
                                      lib.logits(model.extractor(x)).numpy())
        drawn = predict_logits(model, x, samples=4, seed=3)
        again = predict_logits(model, x, samples=4, seed=3)
        saved = lib.rho.clone()
        lib.rho.fill_(-30.0)  # sigma ~ 1e-13: the rows' draws are their means
        rows_fixed = predict_logits(model, x, samples=4, seed=3)
        lib.rho.copy_(saved)
    assert torch.equal(drawn, again)  # seeded: the same S networks, rows included
    assert not torch.equal(drawn, rows_fixed)  # the rows are drawn too


# -- the fedbnn rule: rows as likelihoods times the prior (FedBNN Eq. 9) ---------------------
def test_fedbnn_rows_multiply_the_prior_by_the_likelihoods_by_hand():
    # prior: the previous global's row N((0, 0), (1, 1)); likelihoods A: m (1, 0), sigma
    # (1, 1); B: m (3, 2), sigma (1, 0.5). precision = 1 + (1 + 1, 1 + 4) = (3, 6);
    # mean = (0 + 1 + 3, 0 + 0 + 4 * 2) / (3, 6) = (4/3, 4/3). Counts 10 : 30 do not weigh:
    # a likelihood already carries its samples.
    prev = gtable(["x"], [0, 0], [1, 1], [5])
    a = gtable(["x"], [1, 0], [1, 1], [10])
    b = gtable(["x"], [3, 2], [1, 0.5], [30])
    counters: Counter = Counter()
    out = average_tables([a, b], prev, 1.0, counters=counters, likelihood=[True, True],
                         prior_sigma=0.05)
    np.testing.assert_allclose(out.rows[0], [4 / 3, 4 / 3], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(3), 1 / math.sqrt(6)], rtol=1e-6)
    assert out.counts.tolist() == [45]
    assert counters["prototype_fedbnn_entries"] == 4 and counters["prototype_fedbnn_clamped"] == 0
    # mixed 0.5 : 0.5 with the previous row: mu = 2/3 (both); var = 0.5 (1/3, 1/6) + 0.5
    # + 0.25 (4/3)^2 = (10/9, 37/36)
    out = average_tables([a, b], prev, 0.5, likelihood=[True, True], prior_sigma=0.05)
    np.testing.assert_allclose(out.rows[0], [2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], np.sqrt([10 / 9, 37 / 36]), rtol=1e-6)
    # the conflation of the same rows (posteriors, sample-weighted r = (0.5, 1.5)) for
    # comparison: no prior term, precision (0.5 + 1.5, 0.5 + 6) = (2, 6.5)
    conf = average_tables([a, b], prev, 1.0)
    np.testing.assert_allclose(conf.sigmas[0], 1 / np.sqrt([2, 6.5]), rtol=1e-6)


def test_fedbnn_a_new_label_starts_from_the_bayes_sigma_prior():
    # label "y" is not in the global: prior N(0, 0.5^2), precision 4. One likelihood m (2, 7),
    # sigma (0.5, LIK_SIGMA_MAX: no information, clamped to LIK_FLOOR and counted):
    # precision (4 + 4, 4 + 2^-20); mean (8 / 8, 7 * 2^-20 / (4 + 2^-20)); no mixing (new)
    prev = gtable(["x"], [5, 5], [1, 1], [3])
    new = gtable(["y"], [2, 7], [0.5, 1024], [6])
    counters: Counter = Counter()
    out = average_tables([new], prev, 0.5, counters=counters, likelihood=[True],
                         prior_sigma=0.5)
    assert out.labels == ("x", "y")
    lam = 2.0**-20
    np.testing.assert_allclose(out.rows[1], [1.0, 7 * lam / (4 + lam)], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[1], [1 / math.sqrt(8), 1 / math.sqrt(4 + lam)],
                               rtol=1e-6)
    np.testing.assert_array_equal(out.rows[0], prev.rows[0])  # nobody sent "x"
    assert counters["prototype_fedbnn_clamped"] == 1
    with pytest.raises(ValueError, match="prior sigma"):
        average_tables([new], prev, 0.5, likelihood=[True])


def test_fedbnn_a_tiny_likelihood_sigma_does_not_own_the_row():
    # attack: three likelihoods for "x" (prior N(0, 1)): two honest m 0, sigma 1; the third
    # m 10, sigma 1e-6 (precision 1e12). The floor (0.5 x the median 1) raises it to 0.5,
    # precision 4: mean = 4 * 10 / (1 + 1 + 1 + 4) = 40/7, sigma 1/sqrt(7); without the floor
    # the row is the attacker's (10 to 1e-10)
    prev = gtable(["x"], [0], [1], [0])
    sent = [gtable(["x"], [0], [1], [10]), gtable(["x"], [0], [1], [10]),
            gtable(["x"], [10], [1e-6], [10])]
    counters: Counter = Counter()
    out = average_tables(sent, prev, 1.0, counters=counters, sigma_floor=0.5,
                         likelihood=[True] * 3, prior_sigma=0.05)
    np.testing.assert_allclose(out.rows[0], [40 / 7], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(7)], rtol=1e-6)
    assert counters["prototype_sigma_floored"] == 1
    owned = average_tables(sent, prev, 1.0, likelihood=[True] * 3, prior_sigma=0.05)
    assert owned.rows[0, 0] > 10 - 1e-5


def test_fedbnn_rows_of_the_standard_network_phase_are_averaged_or_left_out():
    # no likelihood in the round (bnn_init_rounds): sample-weighted means of mu and sigma,
    # 10 : 30 -> mu 0.25 * 1 + 0.75 * 3 = 2.5, sigma 0.25 * 1 + 0.75 * 0.5 = 0.625 (new label)
    empty = LabelRows.empty(1, gaussian=True)
    a, b = gtable(["x"], [1], [1], [10]), gtable(["x"], [3], [0.5], [30])
    out = average_tables([a, b], empty, 0.5, likelihood=[False, False], prior_sigma=0.05)
    np.testing.assert_allclose(out.rows[0], [2.5], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [0.625], rtol=1e-6)
    # with a likelihood in the round, the other row is left out: N(0, 1) x N(3, 0.5^2) =
    # precision 5, mean 12 / 5
    counters: Counter = Counter()
    out = average_tables([a, b], empty, 0.5, counters=counters, likelihood=[False, True],
                         prior_sigma=1.0)
    np.testing.assert_allclose(out.rows[0], [2.4], rtol=1e-6)
    np.testing.assert_allclose(out.sigmas[0], [1 / math.sqrt(5)], rtol=1e-6)
    assert counters["prototype_snn_ignored"] == 1 and out.counts.tolist() == [30]


def test_the_row_constants_agree_with_the_gaussian_encoding():
    from edgefcl.federation import gaussian, label_rows, sigma_bounds

    assert sigma_bounds.LIK_SIGMA_MAX == gaussian.LIK_SIGMA_MAX
    assert sigma_bounds.LIK_FLOOR == gaussian.LIK_FLOOR
    assert label_rows.SIGMA_MIN == gaussian.SIGMA_MIN


def test_a_device_sends_its_rows_likelihoods_under_fedbnn():
    # the device's prior of "a" is the global's row N(1, 0.5); a new label "b" has N(0, 0.3)
    lib = PrototypeLibrary(1, sigma=0.3)
    lib.merge(gtable(["a"], [1, 1], [0.5, 0.5], [4]))
    lib.ensure(["b"])
    lib.count(["a", "b"], [2, 3])
    with torch.no_grad():
        lib.rows[:] = torch.tensor([[2.0, 1.0], [1.0, 0.5]])
        # posterior sigmas: a (0.25, 0.5: did not narrow), b (0.1, 0.3)
        sig = torch.tensor([[0.25, 0.5], [0.1, 0.3]], dtype=torch.float64)
        lib.rho[:] = (sig + torch.log(-torch.expm1(-sig))).float()
    out = lib.likelihood_table(lib.table())
    # a[0]: lambda = 16 - 4 = 12, m = (2 * 16 - 1 * 4) / 12 = 7/3; a[1]: invalid -> (1, 1024)
    # b[0]: lambda = 100 - 1/0.09, m = 100 / lambda; b[1]: invalid -> (0.5, 1024)
    lam_b = 100 - 1 / 0.09
    np.testing.assert_allclose(out.rows, [[7 / 3, 1.0], [100 / lam_b, 0.5]], rtol=1e-5)
    np.testing.assert_allclose(out.sigmas, [[1 / math.sqrt(12), 1024],
                                            [1 / math.sqrt(lam_b), 1024]], rtol=1e-5)
    assert out.counts.tolist() == [2, 3] and check_rows(out, 2) is None
