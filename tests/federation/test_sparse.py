"""Sparse updates: index coding, top-k selection, error feedback, per-entry aggregation,
rejection of bad payloads, sparse downlink deltas and honest byte counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.config import ConfigError, FedConfig, LearnConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.indexing import INDEX_FORMATS
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.federation.sparse import (
    IDX,
    VAL,
    SparseEncoder,
    SparseError,
    SparseFedAvg,
    checked_sparse,
    decode_group,
    decode_indices,
    encode_indices,
    index_dtype,
    pad_gaps,
    select,
    to_bfloat16,
)
from edgefcl.federation.strategy import FedAvg, RoundInput
from edgefcl.federation.versions import (
    DELTA_FROM,
    DownlinkState,
    GlobalHistory,
    apply_global_delta,
    downlink_message,
    global_delta,
)
from edgefcl.runtime.roles import check_round_memory
from edgefcl.transport import codec

# -- index coding ---------------------------------------------------------------------------


def test_index_dtype_boundaries():
    got = [index_dtype(v) for v in (0, 255, 256, 65535, 65536, 2**32 - 1, 2**32)]
    assert got == [np.uint8, np.uint8, np.uint16, np.uint16, np.uint32, np.uint32, np.uint64]


def test_indices_are_gaps_with_the_first_absolute():
    codes = encode_indices(np.array([3, 5, 300]))
    assert codes.dtype == np.uint16 and codes.tolist() == [3, 2, 295]
    codes = encode_indices(np.array([0, 1, 255]))
    assert codes.dtype == np.uint8 and codes.tolist() == [0, 1, 254]
    assert decode_indices(codes, 256).tolist() == [0, 1, 255]
    assert encode_indices(np.array([], np.int64)).dtype == np.uint8


@pytest.mark.parametrize("codes,n,reason", [
    ([3, 0], 10, "index-duplicate"),
    ([10], 10, "index-range"),
    ([4, 4, 4], 10, "index-range"),
    ([1, 1, 1, 1], 3, "index-range"),
])
def test_decode_indices_rejects(codes, n, reason):
    with pytest.raises(SparseError) as e:
        decode_indices(np.array(codes, np.uint8), n)
    assert e.value.reason == reason


def test_decode_indices_rejects_signed_dtype():
    with pytest.raises(SparseError) as e:
        decode_indices(np.array([1, 2], np.int32), 10)
    assert e.value.reason == "dtype"


def test_select_topk_and_threshold():
    v = np.array([0.1, -5.0, 3.0, 0.2, -4.0])
    assert select(v, 0.4).tolist() == [1, 4]  # ceil(0.4 * 5) = 2 largest magnitudes
    assert select(v, 0.0, threshold=0.15).tolist() == [1, 2, 3, 4]
    assert select(v, 0.6, threshold=3.5).tolist() == [1, 4]  # top 3, then |v| >= 3.5
    assert select(v, 0.01).tolist() == [1]  # at least one entry
    assert select(v, 1.0).tolist() == [0, 1, 2, 3, 4]


def test_pad_gaps_fills_long_gaps_when_the_narrow_index_is_cheaper():
    pos = np.concatenate([np.arange(0, 1000, 10), [5000]])
    padded = pad_gaps(pos, 4)
    fillers = np.setdiff1d(padded, pos)
    # gap 990 -> 5000 is 4010 long: fillers every 255 entries, 15 of them
    assert fillers.tolist() == [990 + 255 * i for i in range(1, 16)]
    assert encode_indices(padded).dtype == np.uint8
    # one entry per 300: uint8 would double the entries, uint16 costs one byte more each
    sparse = np.arange(0, 30000, 300)
    assert pad_gaps(sparse, 4).tolist() == sparse.tolist()
    assert pad_gaps(np.array([0, 600], np.int64), 4).tolist() == [0, 600]


# -- round trips ----------------------------------------------------------------------------


@st.composite
def sparse_tensors(draw):
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    n = math.prod(shape)
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(["float32", "float16"]))
    rng = np.random.default_rng(seed)
    pos = np.flatnonzero(rng.random(n) < density)
    vals = rng.normal(0, 100, pos.size).astype(dtype)
    return shape, pos, vals


@settings(max_examples=60, deadline=None)
@given(sparse_tensors(), st.sampled_from([None, "<f2"]))
def test_sparse_round_trip_through_the_wire_codec(t, wire):
    shape, pos, vals = t
    idx = encode_indices(pos)
    upd = Update("c1", 0, 1, 0, 4, 10, {"w" + IDX: idx, "w" + VAL: vals}, "sparse")
    back = codec.decode(codec.encode(upd, fleet="f", wire_dtype=wire))
    assert back.tensors["w" + IDX].dtype == idx.dtype
    got_pos, got_vals = decode_group({"idx": back.tensors["w" + IDX],
                                      "val": back.tensors["w" + VAL]}, shape,
                                     frozenset({"idx"}))
    assert got_pos.tolist() == pos.tolist()
    expect = vals.astype(np.float16) if wire else vals  # float16 on the wire rounds float32
    np.testing.assert_array_equal(got_vals, expect.astype(np.float64))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=200, unique=True),
       st.sampled_from([2, 4]))
def test_padded_indices_round_trip_and_keep_every_position(positions, value_bytes):
    pos = np.sort(np.array(positions, np.int64))
    padded = pad_gaps(pos, value_bytes)
    assert set(pos.tolist()) <= set(padded.tolist())
    n = int(padded.max()) + 1 if padded.size else 1
    assert decode_indices(encode_indices(padded), n).tolist() == padded.tolist()


# -- client encoder: selection and error feedback -------------------------------------------


def test_encoder_sends_topk_of_delta_and_vectors_whole():
    enc = SparseEncoder(topk=0.25)
    base = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    cur = {"w": np.array([[1.0, -3.0], [0.5, 2.0]], np.float32),
           "b": np.array([1, 2, 3], np.float32)}
    out = enc.encode(cur, base)
    assert out["w" + IDX].tolist() == [1] and out["w" + VAL].tolist() == [-3.0]
    np.testing.assert_array_equal(out["b"], cur["b"])  # 1-D: whole
    np.testing.assert_array_equal(enc.pending["w"], [1.0, 0.0, 0.5, 2.0])


def test_error_feedback_keeps_the_delta_to_the_true_global():
    """After a merge the client holds global + mix * leftover; its next payload is still its
    exact delta to the global, and the leftover is sent later."""
    enc = SparseEncoder(topk=0.25, mix=0.5)
    g0 = {"w": np.zeros((1, 4), np.float32)}
    x = {"w": np.array([[1.0, -3.0, 0.5, 2.0]], np.float32)}
    enc.encode(x, g0)  # sends entry 1 (-3), leftover [1, 0, 0.5, 2]
    g1 = {"w": np.array([[0.0, -1.5, 0.0, 0.0]], np.float32)}  # the aggregator's new global
    merged = enc.decode_global(g1, x)
    np.testing.assert_array_equal(merged["w"], [[0.5, -1.5, 0.25, 1.0]])  # g1 + 0.5 * leftover
    x2 = {"w": merged["w"] + np.array([[0, 0, 0, 0.5]], np.float32)}  # training after the merge
    out = enc.encode(x2, merged)  # base = what the client merged
    # p = x2 - g1 = [0.5, 0, 0.25, 1.5]: the largest, entry 3, is sent
    assert out["w" + IDX].tolist() == [3] and out["w" + VAL].tolist() == [1.5]
    np.testing.assert_allclose(enc.pending["w"], [0.5, 0.0, 0.25, 0.0])


def test_no_merge_between_sends_counts_nothing_twice():
    enc = SparseEncoder(topk=0.5)
    g0 = {"w": np.zeros((1, 2), np.float32)}
    enc.encode({"w": np.array([[1.0, 2.0]], np.float32)}, g0)
    out = enc.encode({"w": np.array([[1.0, 2.0]], np.float32)}, g0)  # no global came in
    assert out["w" + VAL].tolist() == [2.0]  # still the plain delta, no residual added


def test_float16_values_put_their_rounding_into_the_residual():
    enc = SparseEncoder(topk=1.0, value_dtype="float16")
    x = {"w": np.array([[1.0001]], np.float32)}
    out = enc.encode(x, {"w": np.zeros((1, 1), np.float32)})
    assert out["w" + VAL].dtype == np.float16
    sent = float(out["w" + VAL][0])
    assert enc.pending["w"][0] == pytest.approx(np.float32(1.0001) - np.float32(sent))


def test_encoder_rejects_bad_options():
    with pytest.raises(ValueError):
        SparseEncoder(topk=0.0, threshold=0.0)
    with pytest.raises(ValueError):
        SparseEncoder(value_dtype="int8")


# -- aggregation ----------------------------------------------------------------------------


def sparse_update(client, pos, vals, n=10, seq=1, base=0, shape=(4,), batch=4, b=None):
    t = {"w" + IDX: encode_indices(np.array(pos, np.int64)),
         "w" + VAL: np.array(vals, np.float32)}
    if b is not None:
        t["b"] = np.array(b, np.float32)
    return Update(client, base, seq, 0, batch, n, t, "sparse")


def make_agg(initial=None, **kw):
    fed = FedConfig(**{"clients": 2, "burn_in": 2, "jump": 2, "encoding": "sparse", **kw})
    return Aggregator(initial or {"w": np.zeros(4, np.float32)}, fed)


def test_an_entry_beyond_the_global_bound_is_rejected():
    # the attack: sparse entries are averaged over their senders, so an entry only the
    # attacker sends took its value alone (3e38: every later global rejected by every device)
    agg = make_agg()
    assert agg.submit(sparse_update("z", [3], [3e38])) is None
    assert agg.submit(sparse_update("z", [3], [-1.5e6], seq=2, batch=6)) is None
    assert agg.counters["rejected_range"] == 2


def test_a_global_devices_would_reject_is_never_published():
    # the attack: each update stays within the values' bound, but an entry no one else sends
    # is pushed +9e5 at every round (a sparse value is a change on the sender's base), and a
    # negative BatchNorm variance travels under its encoded name; the aggregator drops such a
    # round instead of publishing a version every device rejects
    agg = make_agg({"w": np.zeros(4, np.float32),
                    "bn.running_var": np.ones(2, np.float32)},
                   clip_factor=0.0)  # the last line of defence: clipping bounds these first

    def send(client, pos, vals, seq, var=None):
        u = sparse_update(client, pos, vals, seq=seq, base=agg.global_.version,
                          batch=2 + 2 * seq)
        u.tensors["bn.running_var"] = np.ones(2, np.float32)
        if var is not None:  # the variance as a sparse change, under its encoded name
            del u.tensors["bn.running_var"]
            u.tensors["bn.running_var" + IDX] = encode_indices(np.array([0], np.int64))
            u.tensors["bn.running_var" + VAL] = np.array([var], np.float32)
        return agg.submit(u)

    closed = None
    for r in range(4):
        send("a", [0], [0.1], r + 1)
        closed = send("z", [3], [9e5], r + 1)
    assert closed is not None and closed.global_ is None
    assert agg.counters["dropped_global_range"] >= 1
    assert np.abs(agg.global_.tensors["w"]).max() <= 1e6
    version = agg.global_.version
    send("a", [0], [0.1], 9)
    closed = send("z", [3], [0.0], 9, var=-10.0)
    assert closed is not None and closed.global_ is None
    assert agg.counters["dropped_global_variance"] == 1 and agg.global_.version == version
    assert (agg.global_.tensors["bn.running_var"] > 0).all()


def test_per_entry_average_over_senders_by_hand():
    # sample-weighted (the default cap weighs two alike), unclipped (b's change is 4.5x a's)
    agg = make_agg(max_share=1.0, clip_factor=0.0)
    agg.submit(sparse_update("a", [1], [2.0], n=10))
    closed = agg.submit(sparse_update("b", [1, 3], [4.0, 8.0], n=30))
    # entry 1: (10*2 + 30*4)/40 = 3.5, mixed 0.5 -> 1.75; entry 3: only b -> 8 * 0.5 = 4
    np.testing.assert_allclose(closed.global_.tensors["w"], [0.0, 1.75, 0.0, 4.0])


def test_an_entry_no_one_else_sends_is_clipped_like_a_dense_change():
    # the attack: an entry's value is averaged over the clients that send it, so one device
    # that alone sends an entry set it by itself, up to the values' bound: +9e5, mixed 0.5,
    # moved the global's entry by 4.5e5 in one round. A sparse update's change (its entries'
    # values, changes on its base, and its whole tensors' difference to the global) is now
    # clipped at 3 x the round's median change norm, as a dense update's is
    agg = make_agg({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, clients=3)
    for c in ("a", "b"):  # honest: change norm sqrt(0.3^2 + 0.4^2) = 0.5
        agg.submit(sparse_update(c, [0], [0.3], b=[0.4, 0.0]))
    closed = agg.submit(sparse_update("z", [3], [9e5], b=[0.0, 0.0]))
    assert agg.counters["clipped"] == 1
    # z's change scaled to tau = 3 x 0.5: entry 3 = 1.5 (its sender's alone), mixed 0.5
    np.testing.assert_allclose(closed.global_.tensors["w"], [0.15, 0.0, 0.0, 0.75], rtol=1e-6)
    np.testing.assert_allclose(closed.global_.tensors["b"], [0.4 / 3, 0.0], rtol=1e-6)


def test_an_update_alone_after_a_spill_is_clipped_with_the_rounds_before():
    # a reviewer helper's attack: a round that fills `round_max_mib` below its quorum folds
    # (spills) what it holds, clipped among themselves; the update that arrived after was
    # clipped alone, as its own bound (3 x its own norm): entry 3 moved by 4.5e5
    mib = 1.5 * sparse_update("a", [0], [0.5]).nbytes / (1 << 20)  # two honest ones fill it
    agg = make_agg(clients=5, min_clients=2, mode="async", burn_in=0, jump=1,
                   round_timeout=1e9, round_max_mib=mib)
    for c in "abcdz":
        agg.join(c, 0.0)  # 5 active: a quorum of 3, so two updates that fill the round spill
    assert agg.submit(sparse_update("a", [0], [0.5], batch=1), 0.0) is None
    assert agg.submit(sparse_update("b", [0], [0.5], batch=1), 0.0) is None
    assert agg.counters["spilled"] == 2
    closed = agg.submit(sparse_update("z", [0, 1, 2, 3], [0.0, 0.0, 0.0, 9e5], batch=1), 0.0)
    assert closed is not None and closed.global_ is not None
    # clipped at 3 x the median of 0.5, 0.5 and its own: entry 3 = 1.5, mixed 0.5
    assert agg.counters["clipped"] == 1
    np.testing.assert_allclose(closed.global_.tensors["w"][3], 0.75, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_clipped_change_keeps_its_wire_dtype(dtype):
    agg = make_agg(clients=3)
    for c in ("a", "b"):
        agg.submit(sparse_update(c, [0], [0.5]))
    u = sparse_update("z", [3], [0.0])
    del u.tensors["w" + VAL]
    if dtype == "float16":
        u.tensors["w" + VAL] = np.array([6e4], np.float16)
    else:
        u.tensors["w::bf16"] = to_bfloat16(np.array([6e5], np.float32))
    closed = agg.submit(u)
    assert agg.counters["clipped"] == 1
    np.testing.assert_allclose(closed.global_.tensors["w"], [0.25, 0, 0, 0.75], rtol=1e-2)


def test_the_fold_reuses_what_validation_decoded_and_only_for_the_same_tensors(monkeypatch):
    # a sparse payload was decoded and checked twice: at arrival and again at the close
    # (0.42 ms of the 1.7 ms a demo update cost the daemon); the fold now reuses the first
    import edgefcl.federation.sparse as sparse_mod

    agg = make_agg(clients=3, mode="async", burn_in=0, jump=1, round_timeout=1e9)
    for c in "abz":
        agg.join(c, 0.0)
    a = sparse_update("a", [0, 2], [0.5, 0.25], batch=1)
    assert agg.submit(a, 0.0) is None
    assert a.checked is not None and a.checked.nbytes == 2 * (4 + 4)  # int32 + float32
    assert a.nbytes == sum(t.nbytes for t in a.tensors.values()) + 16  # counted in the round
    assert agg.submit(sparse_update("b", [0], [0.5], batch=1), 0.0) is None
    decoded = []
    real = sparse_mod.decode_payload
    monkeypatch.setattr(sparse_mod, "decode_payload",
                        lambda *args, **kw: decoded.append(1) or real(*args, **kw))
    u = sparse_update("z", [3], [9e5], batch=1)  # clipped: new tensors, decoded afresh
    closed = agg.submit(u, 0.0)
    assert agg.counters["clipped"] == 1
    assert len(decoded) == 2  # z at arrival, and z's clipped copy at the fold: a, b reused
    # by hand, each entry over its senders, mixed 0.5: entry 0 (0.5 + 0.5) / 2, entry 2 a's
    # alone, entry 3 z's clipped to 3 x the median change norm (a's sqrt(0.5^2 + 0.25^2))
    np.testing.assert_allclose(closed.global_.tensors["w"],
                               [0.25, 0, 0.125, 0.5 * 3 * math.sqrt(0.3125)], rtol=1e-6)


def full_update(client, shape, dtype=np.float16, batch=4):
    """A valid sparse update that sends every entry (bitmap index): 2-4 B an entry on the
    wire, 8 B more decoded."""
    n = math.prod(shape)
    wire, covered = INDEX_FORMATS["bits"].encode(np.arange(n, dtype=np.int64), n, 2)
    return Update(client, 0, 1, 0, batch, 10, {"w::bits": wire,
                                            "w::val": np.full(covered.size, 1e-3, dtype)},
                  "sparse")


def test_rounds_that_hold_every_update_keep_no_decoded_payload():
    # a reviewer helper's finding: a rule that cannot spill (a prototype library here) holds
    # every update until min_clients, bounded only by the start-up check on the wire's bytes
    # (min_clients x 4 B per entry <= round_max_mib); with the decoded payload kept beside
    # each update two of three held 5.06 MiB under a bound of 3
    fed = FedConfig(clients=3, min_clients=3, encoding="sparse", mode="async",
                    round_max_mib=3.0, burn_in=2, jump=2, quorum=1.0)
    cfg = RunConfig(learn=LearnConfig(method="fedavg", head="prototypes"), fed=fed)
    initial = {"w": np.zeros((512, 512), np.float32)}  # 1 MiB
    check_round_memory(cfg, initial)  # accepted: 3 x 1 MiB <= 3 MiB
    agg = Aggregator(initial, fed, prototypes=LabelRows.empty(2))
    assert not agg.spills and not agg.keeps_decoded
    for c in "ab":
        assert agg.submit(full_update(c, (512, 512))) is None
    assert agg.counters["accepted"] == 2
    assert agg._round.nbytes <= fed.round_max_mib * (1 << 20)
    assert all(u.checked is None for u in agg._round.updates.values())


def test_an_update_kept_for_the_task_gate_keeps_no_decoded_payload():
    # it outlives its round: a carried update decodes afresh, and the gate's budget counts
    # its own bytes (with the decoded payload the same budget kept 5x fewer devices)
    agg = make_agg(clients=3, mode="async", burn_in=0, jump=1, round_timeout=1e9,
                   task_gate=1, gate_carry_mib=64)
    assert agg.keeps_decoded and agg.carries
    u = full_update("a", (4,), batch=1)
    assert agg.submit(u, 0.0) is None
    assert u.checked is not None
    kept, size = agg.task_ends.kept["a"]
    assert kept.checked is None and size == sum(t.nbytes for t in u.tensors.values())


def test_a_decoded_payload_is_reused_for_its_own_tensors_and_spec_only():
    u = sparse_update("a", [1], [2.0])
    spec = {"w": (4,)}
    reason, checked = checked_sparse(u.tensors, spec)
    assert reason is None and checked.for_(u.tensors, spec) is not None
    assert checked.for_(dict(u.tensors), spec) is None  # a copy (clipped, replaced) decodes
    assert checked.for_(u.tensors, {"w": (2, 2)}) is None  # another spec decodes
    pos, vals = checked.value.entries["w"]
    assert pos.dtype == np.int32 and vals.dtype == np.float32
    assert checked_sparse(u.tensors, {"w": (1,)}) == ("index-range", None)


def test_delta_is_rebuilt_on_the_global_the_client_merged():
    agg = make_agg({"w": np.ones(4, np.float32)})
    agg.submit(sparse_update("a", [0], [1.0], seq=1))
    agg.submit(sparse_update("b", [0], [1.0], seq=1))  # v1: w[0] = 0.5*2 + 0.5*1 = 1.5
    assert agg.global_.tensors["w"][0] == 1.5
    # a is still based on v0 (w = 1): its value at entry 2 is 1 + 3 = 4
    agg.submit(sparse_update("a", [2], [3.0], seq=2, base=0, batch=6))
    closed = agg.submit(sparse_update("b", [2], [-1.0], seq=2, base=1, batch=6))
    # b based on v1: 1 - 1 = 0; mean (4 + 0)/2 = 2, mixed with 1 -> 1.5
    np.testing.assert_allclose(closed.global_.tensors["w"], [1.5, 1.0, 1.5, 1.0])
    assert "sparse_rebased" not in agg.counters


def test_base_out_of_history_is_rebased_and_counted():
    agg = make_agg(max_staleness=0)  # history holds the current global only
    agg.submit(sparse_update("a", [0], [2.0], seq=1))
    agg.submit(sparse_update("b", [0], [2.0], seq=1))  # v1: w[0] = 1
    agg.submit(sparse_update("a", [1], [2.0], seq=2, base=0, batch=6))
    closed = agg.submit(sparse_update("b", [1], [2.0], seq=2, base=1, batch=6))
    np.testing.assert_allclose(closed.global_.tensors["w"], [1.0, 1.0, 0.0, 0.0])
    assert agg.counters["sparse_rebased"] == 1


def test_topk_one_reproduces_dense_fedavg():
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=5)
         .astype(np.float32)}
    clients = [{k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in g.items()}
               for _ in range(3)]
    dense = FedAvg(FedConfig(), {})
    sparse = SparseFedAvg(FedConfig(encoding="sparse"), {k: v.shape for k, v in g.items()})
    sparse.configure_round(RoundInput(0, g, {0: g}.get))
    for i, x in enumerate(clients):
        dense.add(Update(f"c{i}", 0, 1, 0, 4, 10 * (i + 1), x))
        payload = SparseEncoder(topk=1.0).encode(x, g)
        sparse.add(Update(f"c{i}", 0, 1, 0, 4, 10 * (i + 1), payload, "sparse"))
    want, got = dense.result(g), sparse.result(g)
    for k in g:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tensors,reason", [
    ({"w::idx": np.array([4], np.uint8), "w::val": np.array([1.0], np.float32)}, "index-range"),
    ({"w::idx": np.array([1, 0], np.uint8), "w::val": np.array([1, 2], np.float32)},
     "index-duplicate"),
    ({"w::idx": np.array([1, 1], np.uint8), "w::val": np.array([1.0], np.float32)}, "length"),
    ({"w::idx": np.array([1], np.uint8), "w::val": np.array([np.nan], np.float32)},
     "nonfinite"),
    # one pass finds both: the largest magnitude is NaN or infinite when a value is, in the
    # wire's own dtype too (a float16 infinity against the bound cast to float16 passed)
    ({"w::idx": np.array([1, 1], np.uint8), "w::val": np.array([np.inf, 2e6], np.float32)},
     "nonfinite"),
    ({"w::idx": np.array([1, 1], np.uint8), "w::val": np.array([1.0, np.inf], np.float16)},
     "nonfinite"),
    ({"w::idx": np.array([1], np.uint8), "w::val": np.array([-np.inf], np.float16)},
     "nonfinite"),
    ({"w::idx": np.array([1], np.uint8), "w::bf16": np.array([0x7F80], np.uint16)},
     "nonfinite"),
    ({"w::idx": np.array([1], np.uint8), "w::val": np.array([-2e6], np.float32)}, "range"),
    ({"w::idx": np.array([1], np.int16), "w::val": np.array([1.0], np.float32)}, "dtype"),
    ({"w::idx": np.array([1], np.uint8)}, "names"),
    ({"v::idx": np.array([1], np.uint8), "v::val": np.array([1.0], np.float32)}, "names"),
    ({"w::idx": np.array([1], np.uint8), "w::val": np.array([1.0], np.float32),
      "x": np.zeros(1, np.float32)}, "names"),
])
def test_aggregator_rejects_bad_sparse_payloads(tensors, reason):
    agg = make_agg()
    assert agg.submit(Update("a", 0, 1, 0, 4, 10, tensors, "sparse")) is None
    assert agg.counters[f"rejected_{reason}"] == 1 and agg.counters["accepted"] == 0


def test_aggregator_rejects_a_base_from_the_future():
    agg = make_agg()
    agg.submit(sparse_update("a", [1], [1.0], base=5))
    assert agg.counters["rejected_base"] == 1


# -- sparse downlink ------------------------------------------------------------------------


def test_global_delta_is_bit_exact_and_skips_unchanged_tensors():
    old = {"w": np.zeros(1000, np.float32), "b": np.ones(3, np.float32),
           "z": np.zeros(4, np.float32)}
    new = {"w": old["w"].copy(), "b": np.array([1.0, 2.0, 3.0], np.float32),
           "z": np.array([-0.0, 0, 0, 0], np.float32)}
    new["w"][[5, 700]] = [1.5, -2.0]
    delta = global_delta(new, old, 7)
    assert int(delta[DELTA_FROM]) == 7
    assert delta["w" + IDX].tolist() == [5, 695] and delta["w" + VAL].tolist() == [1.5, -2.0]
    assert "b" in delta  # 2 of 3 changed: whole tensor is smaller than idx + values
    out = apply_global_delta(delta, old)
    for k in new:
        assert out[k].tobytes() == new[k].tobytes()  # -0.0 included
    assert global_delta({"w": new["w"]}, old, 7) is None  # a name disappeared


def test_downlink_through_the_codec_and_the_client_state():
    hist = GlobalHistory(3)
    g0 = {"w": np.arange(600, dtype=np.float32)}
    g1 = {"w": g0["w"].copy()}
    g1["w"][[3, 599]] = [-1.0, 7.5]
    hist.push(0, g0)
    hist.push(1, g1)
    msg = downlink_message(GlobalModel(1, g1, ("a",), counted={"a": 4}), hist, held_version=0)
    assert DELTA_FROM in msg.tensors and msg.counted == {"a": 4}
    back = codec.decode(codec.encode(msg, fleet="f"))
    assert len(codec.encode(msg, fleet="f")) < 0.1 * len(codec.encode(GlobalModel(1, g1),
                                                                     fleet="f"))
    state = DownlinkState(g0, 0)
    got = state.resolve(back)
    assert got.version == 1 and got.tensors["w"].tobytes() == g1["w"].tobytes()
    assert got.participants == ("a",) and got.counted == {"a": 4}  # what a device merges by
    with pytest.raises(ValueError, match="holds v1"):
        state.resolve(back)  # a delta from v0 to a client that holds v1
    assert downlink_message(GlobalModel(2, g1), hist, held_version=-5).tensors is g1


def test_history_is_bounded():
    hist = GlobalHistory(2)
    for v in range(5):
        hist.push(v, {"w": np.full(1, v, np.float32)})
    assert hist.versions() == [3, 4] and hist.get(2) is None


# -- configuration and whole runs -----------------------------------------------------------


def test_config_checks():
    with pytest.raises(ConfigError, match="topk"):
        apply(RunConfig(), {"fed": {"encoding": "sparse", "topk": 1.5}})
    with pytest.raises(ConfigError, match="threshold"):
        apply(RunConfig(), {"fed": {"encoding": "sparse", "topk": 0.0}})
    with pytest.raises(ConfigError, match="fedavg"):
        apply(RunConfig(), {"fed": {"encoding": "sparse", "aggregation": "class-weighted"}})


def tiny(**fed):
    return apply(RunConfig(), {
        "quiet": True, "data": {"tasks": 2}, "fed": {"clients": 2, **fed},
        "learn": {"method": "er", "local_epochs": 1, "hidden": 32, "model": "mlp",
                  "memory_size": 20}})


def test_sparse_downlink_run_is_identical_to_dense_downlink_and_bytes_are_real():
    from edgefcl.learn.models import build_model
    from edgefcl.learn.params import get_tensors
    from edgefcl.sim.outcome import encoded_size
    from edgefcl.sim.runs import simulate

    dense = simulate(tiny(encoding="sparse", topk=0.2, downlink="dense"))
    delta = simulate(tiny(encoding="sparse", topk=0.2, downlink="sparse"))
    assert dense.rounds > 5 and dense.global_sha256 == delta.global_sha256
    np.testing.assert_array_equal(dense.acc, delta.acc)
    assert dense.comm.bytes_up == delta.comm.bytes_up
    assert sum(delta.comm.per_round_down) == delta.comm.bytes_down
    assert set(delta.comm.down) == set(delta.comm.up) == {"c000", "c001"}
    # MLP 64-32-10 (2410 parameters): what a dense update or global would cost on the wire
    model = get_tensors(build_model("mlp", (64,), 10, 32))
    full = encoded_size(Update("c000", 0, 1, 0, 4, 10, model, class_counts={0: 5}), tiny())
    assert 2410 * 4 < full < 2410 * 4 + 600
    updates = dense.extra["aggregator"]["accepted"]
    assert dense.comm.bytes_up < 0.35 * updates * full  # 20% of entries + 1-byte indices
    assert sum(dense.comm.per_round_down) == dense.comm.bytes_down
    assert delta.comm.bytes_down < 0.6 * dense.comm.bytes_down
    upd = Update("c000", 0, 1, 0, 4, 10, {"w": np.zeros(3, np.float32)})
    assert encoded_size(upd, tiny()) == len(codec.encode(upd, fleet="demo"))


def test_tick_is_not_counted_as_an_update():
    agg = make_agg()
    agg.submit(Tick("a", 1, 0, 3))
    assert agg.counters["ticks"] == 1
