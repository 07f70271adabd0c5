"""Uncertainty scores against hand-computed values and their invariances."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.methods import SCORES
from edgefcl.learn.scoring import scores

LN2 = math.log(2.0)

# P=2 views, N=2 samples, C=3 classes.
# sample 0: view 1 softmax = [1/4, 1/4, 1/2], view 2 softmax = [1/2, 1/4, 1/4]
# sample 1: both views [1, 2, 3]
LOGITS = torch.tensor(
    [
        [[0.0, 0.0, LN2], [1.0, 2.0, 3.0]],
        [[LN2, 0.0, 0.0], [1.0, 2.0, 3.0]],
    ]
)
# sample 1: softmax([1, 2, 3]) = [e^-2, e^-1, 1] / S
S1 = 1.0 + math.exp(-1.0) + math.exp(-2.0)
P1 = [math.exp(-2.0) / S1, math.exp(-1.0) / S1, 1.0 / S1]


def test_bregman_information_by_hand() -> None:
    # sample 0: LSE(z1) = LSE(z2) = ln 4; mean z = [ln2/2, 0, ln2/2], LSE = ln(1 + 2 sqrt 2)
    expected = [math.log(4.0) - math.log(1.0 + 2.0 * math.sqrt(2.0)), 0.0]
    got = scores.bregman_information(LOGITS)
    assert got.shape == (2,) and got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx(0.0438403, abs=1e-7)


def test_softmax_scores_by_hand() -> None:
    # sample 0: pbar = [3/8, 1/4, 3/8]
    assert scores.mean_probs(LOGITS)[0].tolist() == pytest.approx([0.375, 0.25, 0.375])
    assert scores.least_confidence(LOGITS).tolist() == pytest.approx([0.625, 1.0 - P1[2]], abs=1e-6)
    assert scores.margin(LOGITS).tolist() == pytest.approx([0.0, P1[2] - P1[1]], abs=1e-6)
    # top2 / top1 of softmax([1, 2, 3]) is e^(2 - 3)
    assert scores.ratio(LOGITS).tolist() == pytest.approx([1.0, math.exp(-1.0)], abs=1e-6)
    en0 = -(2 * 0.375 * math.log(0.375) + 0.25 * math.log(0.25))
    en1 = -sum(p * math.log(p) for p in P1)
    assert en0 == pytest.approx(1.082196, abs=1e-6)
    assert scores.entropy(LOGITS).tolist() == pytest.approx([en0, en1], abs=1e-6)


def test_agreement_by_hand() -> None:
    # sample 0: views vote class 2 and class 0 -> 1 - 1/2; sample 1: both vote class 2
    assert scores.agreement(LOGITS).tolist() == pytest.approx([0.5, 0.0])
    # P=3, N=1: votes 1, 1, 0 -> 1 - 2/3
    z = torch.tensor([[[0.0, 5.0]], [[1.0, 3.0]], [[2.0, -1.0]]])
    assert scores.agreement(z).tolist() == pytest.approx([1.0 / 3.0])


def _numpy_reference(z: np.ndarray) -> dict[str, np.ndarray]:
    """Plain float64 numpy versions of the formulas, one view at a time."""
    lse = [np.log(np.exp(zi).sum(-1)) for zi in z]
    zbar = z.mean(0)
    bi = np.mean(lse, axis=0) - np.log(np.exp(zbar).sum(-1))
    probs = [np.exp(zi) / np.exp(zi).sum(-1, keepdims=True) for zi in z]
    pbar = np.mean(probs, axis=0)
    srt = np.sort(pbar, -1)
    votes = np.stack([np.bincount(col, minlength=z.shape[2]) for col in z.argmax(-1).T])
    return {
        "bi": bi,
        "lc": 1 - pbar.max(-1),
        "ms": 1 - (srt[:, -1] - srt[:, -2]),
        "rc": srt[:, -2] / srt[:, -1],
        "en": -(pbar * np.log(pbar)).sum(-1),
        "ag": 1 - votes.max(-1) / z.shape[0],
    }


def test_uncertainty_registry_matches_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, size=(7, 11, 5))
    ref = _numpy_reference(z)
    for name in ("bi", "lc", "ms", "rc", "en", "ag"):
        got = scores.uncertainty(name, torch.tensor(z, dtype=torch.float32))
        assert got.shape == (11,)
        np.testing.assert_allclose(got.numpy(), ref[name], atol=1e-5, err_msg=name)


def test_ms_is_one_minus_margin() -> None:
    assert torch.allclose(scores.uncertainty("ms", LOGITS), 1.0 - scores.margin(LOGITS))


def test_bi_zero_when_all_views_equal() -> None:
    view = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(0)) * 3
    z = view.expand(5, 6, 4)
    # zero up to float32 rounding of the mean of the views
    assert torch.all(scores.bregman_information(z) <= 1e-6)
    assert scores.bregman_information(LOGITS[:, 1:]).item() == 0.0
    assert torch.all(scores.agreement(z) == 0.0)


def test_large_logits_are_stable() -> None:
    # BI = mean LSE = 1000 minus LSE([500, 500, 0]) = 500 + ln 2
    z = torch.tensor([[[1000.0, 0.0, 0.0]], [[0.0, 1000.0, 0.0]]])
    assert scores.bregman_information(z).item() == pytest.approx(500.0 - LN2, rel=1e-6)
    confident = torch.tensor([[[1000.0, 0.0, 0.0]], [[900.0, 0.0, -50.0]]])
    assert scores.entropy(confident).item() == pytest.approx(0.0, abs=1e-6)
    for name in SCORES:
        assert torch.isfinite(scores.uncertainty(name, z)).all(), name


def test_bi_per_view_constants_and_class_offsets() -> None:
    """BI is unchanged by a constant added to all class logits of one view (LSE(z + c) =
    LSE(z) + c and the mean of the constants cancels), but a class-dependent offset on one
    view changes it."""
    z = torch.zeros(2, 1, 3)
    z_offset = z.clone()
    z_offset[0, 0] += torch.tensor([1.0, 0.0, 0.0])
    # view 1 = [1, 0, 0], view 2 = [0, 0, 0]: BI = (LSE([1,0,0]) + ln 3)/2 - LSE([.5, 0, 0])
    lse = math.log(math.e + 2.0)
    expected = (lse + math.log(3.0)) / 2.0 - math.log(math.exp(0.5) + 2.0)
    assert scores.bregman_information(z_offset).item() == pytest.approx(expected, abs=1e-6)
    assert expected > 0.01


# multiples of 1/4: exact in float64, so shifting keeps every argmax tie and every order
logit_arrays = arrays(
    np.float64,
    st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(2, 6)),
    elements=st.integers(-120, 120).map(lambda v: v / 4),
)


@settings(max_examples=30, deadline=None)
@given(z=logit_arrays, shift=st.floats(-50, 50))
def test_bi_nonnegative_and_shift_invariant(z: np.ndarray, shift: float) -> None:
    t = torch.tensor(z)
    bi = scores.bregman_information(t)
    assert (bi >= 0).all()
    # one constant on all logits of all views
    assert torch.allclose(scores.bregman_information(t + shift), bi, atol=1e-9)
    # a different constant per (view, sample)
    c = torch.linspace(-shift, shift, z.shape[0] * z.shape[1], dtype=t.dtype)
    per_view = t + c.reshape(z.shape[0], z.shape[1], 1)
    assert torch.allclose(scores.bregman_information(per_view), bi, atol=1e-9)
    for name in ("lc", "ms", "rc", "en", "ag"):
        assert torch.allclose(
            scores.uncertainty(name, per_view), scores.uncertainty(name, t), atol=1e-9
        ), name


def test_half_precision_input_scores_in_float32() -> None:
    got = scores.bregman_information(LOGITS.half())
    assert got.dtype == torch.float32
    assert got[0].item() == pytest.approx(0.04384, abs=2e-3)


def test_bad_input_errors() -> None:
    with pytest.raises(DataError, match="shape"):
        scores.entropy(torch.zeros(3, 4))
    with pytest.raises(DataError, match="2 classes"):
        scores.margin(torch.zeros(2, 3, 1))
    with pytest.raises(DataError, match="floating"):
        scores.agreement(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="unknown uncertainty method 'xx'"):
        scores.uncertainty("xx", LOGITS)
