"""The q8 encoding: 8-bit per-tensor affine quantisation of dense updates, its validator
(every byte from a device is untrusted) and its aggregation through the dense rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgefcl.config import FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.federation.q8 import CODES, RANGE, Q8Encoder, check_q8, decode_q8, quantize
from edgefcl.transport import codec

SPEC = {"w": (3, 4), "b": (4,)}
f32 = np.float32


def model(seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(f32) for k, s in SPEC.items()}


def test_round_trip_error_is_at_most_half_a_step() -> None:
    x = model()
    payload = Q8Encoder().encode(x, x)
    assert payload["w" + CODES].dtype == np.uint8 and payload["w" + CODES].shape == (3, 4)
    assert payload["b"].dtype == f32 and np.array_equal(payload["b"], x["b"])  # vectors whole
    lo, step = payload["w" + RANGE]
    back = decode_q8(payload)
    assert back["w"].dtype == f32
    assert np.abs(back["w"] - x["w"]).max() <= step / 2 * (1 + 1e-5)
    assert back["w"].min() == lo and check_q8(payload, SPEC) is None


def test_constant_tensor_has_step_zero() -> None:
    q, rng = quantize(np.full((2, 2), 0.25, f32))
    assert rng.tolist() == [0.25, 0.0] and not q.any()
    assert decode_q8({"w" + CODES: q, "w" + RANGE: rng})["w"].tolist() == [[0.25] * 2] * 2


def test_payload_is_about_a_quarter_of_dense_on_the_wire() -> None:
    x = {"w": np.random.default_rng(0).normal(size=(256, 64)).astype(f32)}
    dense = codec.encode(Update("a", 0, 1, 0, 1, 1, x), fleet="f")
    q8 = codec.encode(Update("a", 0, 1, 0, 1, 1, Q8Encoder().encode(x, x), "q8"), fleet="f")
    assert len(q8) < 0.26 * len(dense)


def good() -> dict[str, np.ndarray]:
    x = model()
    return Q8Encoder().encode(x, x)


@pytest.mark.parametrize("change, reason", [
    (lambda p: p.pop("b"), "names"),
    (lambda p: p.pop("w" + RANGE), "names"),
    (lambda p: p.pop("w" + CODES), "names"),
    (lambda p: p.update(x=np.zeros(1, f32)), "names"),
    (lambda p: p.update(w=np.zeros((3, 4), f32)), "names"),  # both dense and coded
    # the attack: a second code tensor named after the range, which decode looks up as
    # w::q8range::q8range when the round closes
    (lambda p: p.update({"w" + RANGE + CODES: p["w" + CODES]}), "names"),
    (lambda p: p.update({"w" + CODES + RANGE: p["w" + RANGE]}), "names"),
    (lambda p: p.update({"w" + CODES: p["w" + CODES].astype(np.int8)}), "dtype"),
    (lambda p: p.update({"w" + CODES: np.zeros((4, 3), np.uint8)}), "shape"),
    (lambda p: p.update({"w" + RANGE: np.zeros(3, f32)}), "shape"),
    (lambda p: p.update({"w" + RANGE: np.zeros(2, np.float64)}), "dtype"),
    (lambda p: p.update({"w" + RANGE: np.array([np.nan, 1], f32)}), "nonfinite"),
    (lambda p: p.update({"w" + RANGE: np.array([0, -1], f32)}), "nonfinite"),
    (lambda p: p.update({"w" + RANGE: np.array([3e38, 3e38], f32)}), "nonfinite"),
    (lambda p: p.update({"w" + RANGE: np.array([-2e6, 0], f32)}), "range"),
    (lambda p: p.update({"w" + RANGE: np.array([0, 1e4], f32)}), "range"),  # top 2.55e6
    (lambda p: p.update(b=np.full(4, 2e6, f32)), "range"),
    (lambda p: p.update(b=np.zeros(5, f32)), "shape"),
    (lambda p: p.update(b=np.full(4, np.inf, f32)), "nonfinite"),
])
def test_validator_rejects_malformed_payloads(change, reason: str) -> None:  # noqa: ANN001
    p = good()
    change(p)
    assert check_q8(p, SPEC) == reason


names = st.sampled_from(["w", "b", "x", "w::q8", "w::q8range", "b::q8", "b::q8range",
                         "w::q8::q8range", "w::q8range::q8", "::q8"])
dtypes = st.sampled_from([np.uint8, np.int8, np.float32, np.float64, np.float16])
shapes = st.sampled_from([(3, 4), (4,), (2,), (4, 3), (), (12,)])
tensor = st.tuples(dtypes, shapes).flatmap(lambda ds: arrays(ds[0], ds[1]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, tensor, max_size=5))
def test_validator_never_raises_and_what_it_passes_decodes_to_the_spec(payload) -> None:  # noqa: ANN001
    if check_q8(payload, SPEC) is None:
        out = decode_q8(payload)
        assert set(out) == set(SPEC)
        for k, s in SPEC.items():
            assert out[k].shape == s and out[k].dtype == f32 and np.isfinite(out[k]).all()


def test_aggregator_averages_dequantised_updates_and_counts_rejections() -> None:
    fed = FedConfig(clients=2, encoding="q8", burn_in=0, jump=1, mix=1.0, clip_factor=0,
                    max_share=1)
    g = model(0)
    agg = Aggregator(g, fed)
    xs = [model(1), model(2)]
    bad = good()
    bad["w" + RANGE] = np.array([0, -1], f32)
    assert agg.submit(Update("a", 0, 1, 0, 1, 10, bad, "q8")) is None
    assert agg.counters["rejected_nonfinite"] == 1
    extra = {**Q8Encoder().encode(xs[0], g), "x::q8": np.zeros(1, np.uint8)}
    assert agg.submit(Update("a", 0, 2, 0, 2, 10, extra, "q8")) is None
    assert agg.counters["rejected_names"] == 1
    assert agg.submit(Update("a", 0, 3, 0, 2, 10, xs[0], "dense")) is None
    assert agg.counters["rejected_encoding"] == 1
    closed = None
    for c, x in zip("ab", xs, strict=True):
        closed = agg.submit(Update(c, 0, 4, 0, 3, 10, Q8Encoder().encode(x, g), "q8"))
    assert closed is not None and closed.global_ is not None
    want = (decode_q8(Q8Encoder().encode(xs[0], g))["w"].astype(np.float64)
            + decode_q8(Q8Encoder().encode(xs[1], g))["w"]) / 2
    np.testing.assert_allclose(closed.global_.tensors["w"], want, rtol=1e-6)


def test_a_variance_under_a_code_name_is_checked_once_decoded() -> None:
    # the attack: the validator checks variances by name, so a negative BatchNorm variance
    # sent as uint8 codes (a vector may travel coded) reached the global (-0.5 after mixing)
    fed = FedConfig(clients=3, min_clients=2, encoding="q8", burn_in=0, jump=1, clip_factor=0,
                    mode="async")
    g = {"w": np.zeros((3, 4), f32), "bn.running_var": np.ones(4, f32)}
    agg = Aggregator(g, fed)
    honest = Q8Encoder().encode({"w": np.full((3, 4), 0.1, f32), "bn.running_var":
                                 np.ones(4, f32)}, g)
    evil = {**Q8Encoder().encode(g, g), "bn.running_var" + CODES: np.zeros(4, np.uint8),
            "bn.running_var" + RANGE: np.array([-5.0, 0.0], f32)}
    del evil["bn.running_var"]
    assert agg.submit(Update("a", 0, 1, 0, 1, 10, honest, "q8")) is None
    # without z, the round has fewer than min_clients (2): it waits for more
    assert agg.submit(Update("z", 0, 1, 0, 1, 10, evil, "q8")) is None
    assert agg.counters["rejected_variance"] == 1 and set(agg._round.updates) == {"a"}
    b = Q8Encoder().encode({"w": np.full((3, 4), 0.3, f32), "bn.running_var":
                            np.ones(4, f32)}, g)
    closed = agg.submit(Update("b", 0, 1, 0, 1, 10, b, "q8"))
    assert closed is not None and closed.participants == ("a", "b")
    assert (closed.global_.tensors["bn.running_var"] > 0).all()


@pytest.mark.parametrize("rule", ["fedavg", "class-weighted", "median", "trimmed-mean"])
def test_q8_takes_every_dense_rule(rule: str) -> None:
    cfg = apply(RunConfig(), {"fed": {"encoding": "q8", "aggregation": rule}})
    assert (cfg.fed.encoding, cfg.fed.aggregation) == ("q8", rule)
