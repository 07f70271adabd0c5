"""Sparse index formats (gaps, bitmap, zlib) and value dtypes (float32, float16, bfloat16):
round trips through the wire codec for every registered format, the cheapest choice, and
rejection of every malformed index with a reason (never a crash)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.config import ConfigError, FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.indexing import INDEX_FORMATS, decode_positions, encode_cheapest
from edgefcl.federation.messages import Update
from edgefcl.federation.sparse import (
    SparseEncoder,
    SparseError,
    decode_group,
    from_bfloat16,
    to_bfloat16,
    value_part,
)
from edgefcl.transport import codec

FORMS = frozenset({*INDEX_FORMATS, "dense"})


@st.composite
def positions(draw):
    n = draw(st.integers(1, 5000))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.3, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    pos = np.flatnonzero(np.random.default_rng(seed).random(n) < density).astype(np.int64)
    return pos, n


@settings(max_examples=50, deadline=None)
@given(positions(), st.sampled_from(sorted(INDEX_FORMATS)), st.sampled_from([2, 4]))
def test_every_index_format_round_trips_through_the_wire_codec(pn, suffix, value_bytes):
    pos, n = pn
    wire, covered = INDEX_FORMATS[suffix].encode(pos, n, value_bytes)
    assert set(pos.tolist()) <= set(covered.tolist())
    upd = Update("c1", 0, 1, 0, 4, 10, {"w::" + suffix: wire,
                                        "w::val": np.ones(covered.size, np.float32)}, "sparse")
    back = codec.decode(codec.encode(upd, fleet="f"), require_digest=True)
    got = decode_positions(suffix, back.tensors["w::" + suffix], n, covered.size)
    assert got.tolist() == covered.tolist()


@settings(max_examples=40, deadline=None)
@given(positions(), st.sampled_from([2, 4]))
def test_the_cheapest_format_is_no_larger_than_any_other(pn, value_bytes):
    pos, n = pn
    suffix, wire, covered = encode_cheapest(pos, n, value_bytes)
    cost = wire.nbytes + covered.size * value_bytes
    for fmt in INDEX_FORMATS.values():
        w, c = fmt.encode(pos, n, value_bytes)
        assert cost <= w.nbytes + c.size * value_bytes
    assert decode_positions(suffix, wire, n, covered.size).tolist() == covered.tolist()


def test_bitmap_wins_dense_selections_and_gaps_sparse_ones():
    n = 10_000
    every_other = np.arange(0, n, 2)
    assert encode_cheapest(every_other, n, 4)[0] in ("bits", "zbits")
    assert encode_cheapest(np.array([7, 9000]), n, 4)[0] == "idx"
    assert encode_cheapest(every_other, n, 4, allowed=("idx",))[0] == "idx"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_subnormal=False), max_size=50),
       st.sampled_from(["float32", "float16", "bfloat16"]))
def test_values_round_trip_and_report_what_the_receiver_reads(xs, value_dtype):
    # values the receiver accepts: at most MAX_VALUE (1e6) in magnitude, what devices accept
    # in a global (float16 saturates at 65504, finite)
    x = np.array(xs, np.float32)
    suffix, wire, received = value_part(x, value_dtype)
    got = decode_group({"idx": np.ones(x.size, np.uint8), suffix: wire}, (x.size + 1,), FORMS)
    np.testing.assert_array_equal(got[1], received.astype(np.float64))
    assert np.isfinite(received).all()
    if value_dtype == "bfloat16":  # relative rounding error of 8 significant bits
        small = np.abs(x) > 1e-37  # normal range
        np.testing.assert_allclose(received[small], x[small], rtol=2**-8)


@pytest.mark.parametrize("value", [1.5e6, -3e38])
def test_values_beyond_the_global_bound_are_refused(value):
    x = np.array([0.5, value], np.float32)
    suffix, wire, _ = value_part(x, "float32")
    with pytest.raises(SparseError, match="beyond"):
        decode_group({"idx": np.ones(2, np.uint8), suffix: wire}, (3,), FORMS)


def test_bfloat16_rounds_to_nearest_even_by_hand():
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3.4e38], np.float32)
    back = from_bfloat16(to_bfloat16(x))
    assert back[:4].tolist() == [1.0, 1.0, 1 + 2**-6, -2.5]
    assert np.isfinite(back[4]) and back[4] > 3e38


def test_bfloat16_and_float16_rounding_goes_into_the_residual():
    for vd in ("float16", "bfloat16"):
        enc = SparseEncoder(topk=1.0, value_dtype=vd)
        base = {"w": np.zeros((2, 2), np.float32)}
        cur = {"w": np.array([[1.001, -3.0007], [0.5003, 2.0001]], np.float32)}
        out = enc.encode(cur, base)
        sent = [k for k in out if not k.endswith(("::idx", "::bits"))][0]
        _, received = decode_group({"idx": np.array([0, 1, 1, 1], np.uint8),
                                    sent.split("::")[1]: out[sent]}, (2, 2), FORMS)
        np.testing.assert_allclose(received + enc.pending["w"], cur["w"].ravel(), atol=1e-7)



@pytest.mark.parametrize("parts,reason", [
    ({"bits": np.array([0b1000_0000, 0, 0], np.uint8)}, "length"),  # 20 entries: 3 bytes ok
    ({"bits": np.array([0b1000_0000, 0], np.uint8)}, "length"),  # 2 bytes for 20 entries
    ({"bits": np.array([0, 0, 0b0000_1000], np.uint8)}, "index-range"),  # padding bit set
    ({"bits": np.array([1, 0, 0], np.uint16)}, "dtype"),
    ({"zidx": np.frombuffer(b"not zlib", np.uint8)}, "compression"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([0]) + bytes(10**6)), np.uint8)},
     "compression"),  # expands far past what 20 entries need
    ({"zidx": np.frombuffer(zlib.compress(bytes([0]) + bytes([1] * 9)), np.uint8)},
     "compression"),  # 9 bytes of positions for 1 value: past 8 bytes a value (an index of
    # a few KB expanded to a tensor's largest index before its one value was counted)
    ({"zidx": np.frombuffer(zlib.compress(bytes([0, 3, 0])), np.uint8)}, "index-duplicate"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([0, 25])), np.uint8)}, "index-range"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([1, 3, 0, 4])), np.uint8)}, "length"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([7, 3])), np.uint8)}, "compression"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([0, 3]))[:-2], np.uint8)}, "compression"),
    ({"zidx": np.frombuffer(zlib.compress(bytes([0, 3])) + b"x", np.uint8)}, "compression"),
    ({"zbits": np.frombuffer(zlib.compress(bytes([0, 1, 0])), np.uint8)}, "length"),
    ({"idx": np.array([3, 0], np.uint8)}, "index-duplicate"),
    ({"idx": np.array([20], np.uint8)}, "index-range"),
    ({"idx": np.array([[1]], np.uint8)}, "shape"),
    ({"bits": np.array([0, 0, 0], np.uint8), "idx": np.array([1], np.uint8)}, "names"),
    ({"rows": np.array([1], np.uint8)}, "names"),  # rows are for apc, not sparse
])
def test_malformed_indices_are_rejected_with_a_reason(parts, reason):
    parts = dict(parts)
    if reason == "length" and "bits" in parts and parts["bits"].size == 3:
        parts["val"] = np.ones(2, np.float32)  # one bit set, two values
    else:
        parts.setdefault("val", np.ones(1, np.float32))
    with pytest.raises(SparseError) as e:
        decode_group(parts, (4, 5), frozenset({*INDEX_FORMATS, "dense"}))
    assert e.value.reason == reason


@pytest.mark.parametrize("values,reason", [
    ({"bf16": np.array([0x7F80], np.uint16)}, "nonfinite"),  # +inf
    ({"bf16": np.array([0x7FC1], np.uint16)}, "nonfinite"),  # NaN
    ({"bf16": np.array([1.0], np.float32)}, "dtype"),
    ({"bf16": np.array([1, 2], np.uint16)}, "length"),
    ({"val": np.array([1], np.uint16)}, "dtype"),
    ({"val": np.ones(1, np.float32), "bf16": np.ones(1, np.uint16)}, "names"),
])
def test_bad_values_are_rejected_with_a_reason(values, reason):
    with pytest.raises(SparseError) as e:
        decode_group({"idx": np.array([2], np.uint8), **values}, (4, 5), FORMS)
    assert e.value.reason == reason


def test_aggregator_counts_a_zip_bomb_and_keeps_serving():
    g = {"w": np.zeros((4, 5), np.float32)}
    agg = Aggregator(g, FedConfig(encoding="sparse", mode="async", min_clients=1))
    bomb = np.frombuffer(zlib.compress(bytes([0]) + bytes(10**7)), np.uint8)
    agg.submit(Update("a", 0, 1, 0, 4, 10, {"w::zidx": bomb, "w::val": np.ones(1, np.float32)},
                      "sparse"), now=0.0)
    assert agg.counters["rejected_compression"] == 1
    enc = SparseEncoder(topk=0.5, value_dtype="bfloat16")
    ok = enc.encode({"w": np.arange(20, dtype=np.float32).reshape(4, 5)}, g)
    closed = agg.submit(Update("b", 0, 1, 0, 4, 10, ok, "sparse"), now=0.0)
    assert agg.counters["accepted"] == 1 and closed is not None


def test_config_accepts_the_new_options_and_rejects_bad_ones():
    cfg = apply(RunConfig(), {"fed": {"encoding": "sparse", "value_dtype": "bfloat16",
                                      "index_format": "zbits"}})
    assert cfg.fed.index_format == "zbits"
    for bad in ({"index_format": "gzip"}, {"value_dtype": "float8"},
                {"encoding": "apc", "value_dtype": "bfloat16"}):
        with pytest.raises(ConfigError):
            apply(RunConfig(), {"fed": bad, "learn": {"method": "apc"}}
                  if bad.get("encoding") == "apc" else {"fed": bad})


@pytest.mark.parametrize("index_format", ["idx", "bits", "zidx", "zbits"])
def test_encoder_honours_a_fixed_index_format(index_format):
    enc = SparseEncoder(topk=0.3, index_format=index_format)
    out = enc.encode({"w": np.arange(40, dtype=np.float32).reshape(5, 8)},
                     {"w": np.zeros((5, 8), np.float32)})
    assert f"w::{index_format}" in out


def test_auto_value_dtype_is_float16_below_topk_one_and_float32_at_one():
    g = {"w": np.zeros((4, 5), np.float32)}
    cur = {"w": np.arange(20, dtype=np.float32).reshape(4, 5) / 7}
    assert SparseEncoder(topk=0.5).encode(cur, g)["w::val"].dtype == np.float16
    exact = SparseEncoder(topk=1.0).encode(cur, g)
    assert exact["w::val"].dtype == np.float32
    np.testing.assert_array_equal(np.sort(exact["w::val"]), np.sort(cur["w"].ravel()))


def test_downlink_delta_uses_the_cheapest_format_and_stays_bit_exact():
    from edgefcl.federation.versions import apply_global_delta, global_delta

    rng = np.random.default_rng(1)
    old = {"w": rng.normal(size=(50, 40)).astype(np.float32)}
    new = {"w": old["w"].copy()}
    new["w"].ravel()[rng.random(2000) < 0.3] += 1.0  # 30% changed: a bitmap beats gaps
    delta = global_delta(new, old, 3)
    assert {k.split("::")[1] for k in delta if k.startswith("w::")} <= {"bits", "zbits", "val"}
    assert apply_global_delta(delta, old)["w"].tobytes() == new["w"].tobytes()
    bad = dict(delta)
    key = next(k for k in delta if k.endswith("bits"))
    bad[key] = np.zeros(3, np.uint8)
    with pytest.raises(SparseError):
        apply_global_delta(bad, old)
