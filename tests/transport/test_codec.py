"""Wire codec, chunking and topic names: round trips and rejection of bad payloads."""

from __future__ import annotations

import contextlib
import hashlib
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgefcl.data.types import Batch
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.transport import chunks, codec
from edgefcl.transport.chunks import CHUNK_OVERHEAD, Reassembler, is_chunk, split
from edgefcl.transport.codec import CodecError, Message, check_tensors, spec_hash, tensor_spec
from edgefcl.transport.topics import Topics

FLEET = "f1"
DTYPES = ["<f4", "<f2", "<f8", "<i8", "<i4", "<i2", "|u1", "|i1", "<u8"]
names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12)


@st.composite
def arrays(draw: st.DrawFn, dtypes: list[str] = DTYPES) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    elements = (
        st.floats(-1e4, 1e4, width=dt.itemsize * 8, allow_nan=False, allow_infinity=False)
        if dt.kind == "f" else None
    )
    return draw(hnp.arrays(dt, shape, elements=elements))


@st.composite
def updates(draw: st.DrawFn, dtypes: list[str] = DTYPES) -> Update:
    tensors = draw(st.dictionaries(names, arrays(dtypes), min_size=0, max_size=4))
    counts = draw(st.none() | st.dictionaries(st.integers(0, 99), st.integers(0, 10**6)))
    ints = st.integers(-(2**40), 2**40)
    return Update(
        client=draw(names), base_version=draw(ints), seq=draw(ints), task=draw(ints),
        batch=draw(ints), num_samples=draw(st.integers(0, 10**9)), tensors=tensors,
        encoding=draw(st.sampled_from(["dense", "sparse", "gaussian"])), class_counts=counts,
    )


def _same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        np.testing.assert_array_equal(a[k], b[k])


def _raw(**fields) -> bytes:
    m = {"schema": 1, "kind": "tick", "fleet": FLEET, "sender": "c", "client": "c", "seq": 1,
         "task": 0, "batch": 2}
    m.update(fields)
    return msgpack.packb({k: v for k, v in m.items() if v is not ...}, use_bin_type=True)


def _reason(payload: bytes, **kw) -> str:
    with pytest.raises(CodecError) as e:
        codec.decode(payload, **kw)
    return e.value.reason


# ---------------------------------------------------------------- round trips


@settings(max_examples=60, deadline=None)
@given(updates())
def test_update_round_trip(up: Update) -> None:
    dec = codec.decode(codec.encode(up, fleet=FLEET), FLEET)
    assert isinstance(dec, Update)
    assert (dec.client, dec.base_version, dec.seq, dec.task, dec.batch, dec.num_samples) == (
        up.client, up.base_version, up.seq, up.task, up.batch, up.num_samples)
    assert dec.encoding == up.encoding and dec.class_counts == up.class_counts
    _same_tensors(dec.tensors, up.tensors)
    for t in dec.tensors.values():
        t += 0  # decoded arrays own writable memory


@settings(max_examples=60, deadline=None)
@given(updates())
def test_peek_seq_reads_an_updates_number_without_decoding_it(up: Update) -> None:
    assert codec.peek_seq(codec.encode(up, fleet=FLEET)) == up.seq


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048) | st.builds(
    lambda m: msgpack.packb(m, use_bin_type=True),
    st.dictionaries(st.sampled_from(["seq", "kind", "x", ""]) | st.text(max_size=8),
                    st.integers(-2**63, 2**64 - 1) | st.text() | st.booleans()
                    | st.lists(st.integers(0, 9), max_size=3), max_size=10)))
def test_peek_seq_never_raises_and_reads_only_an_int(payload: bytes) -> None:
    seq = codec.peek_seq(payload)
    assert seq is None or type(seq) is int
    assert codec.peek_seq(_raw(seq=True)) is None and codec.peek_seq(_raw(seq=7)) == 7


@settings(max_examples=40, deadline=None)
@given(updates(dtypes=["<f4", "<i8"]))
def test_float16_wire_round_trip(up: Update) -> None:
    dec = codec.decode(codec.encode(up, fleet=FLEET, wire_dtype="<f2"), FLEET)
    assert list(dec.tensors) == list(up.tensors)
    for k, t in up.tensors.items():
        assert dec.tensors[k].dtype == t.dtype  # float32 comes back as float32, int64 untouched
        want = t.astype(np.float16).astype(np.float32) if t.dtype == np.float32 else t
        np.testing.assert_array_equal(dec.tensors[k], want)


def test_float16_wire_halves_the_tensor_bytes() -> None:
    w = np.linspace(-1, 1, 10_000, dtype=np.float32).reshape(100, 100)
    up = Update("c", 0, 1, 0, 1, 5, {"w": w})
    n32 = len(codec.encode(up, fleet=FLEET))
    n16 = len(codec.encode(up, fleet=FLEET, wire_dtype="<f2"))
    assert 40_000 < n32 < 40_400 and 20_000 < n16 < 20_400
    got = codec.decode(codec.encode(up, fleet=FLEET, wire_dtype="<f2"), FLEET).tensors["w"]
    assert np.abs(got - w).max() <= 2**-11  # float16 rounding near 1 is at most half an ulp


def test_float16_wire_overflow_is_refused_on_encode() -> None:
    up = Update("c", 0, 1, 0, 1, 5, {"w": np.array([1e5], np.float32)})
    with pytest.raises(CodecError) as e:
        codec.encode(up, fleet=FLEET, wire_dtype="<f2")
    assert e.value.reason == "range"


@pytest.mark.parametrize("counted", [{"c3": 1}, {"c1": 0}, {"c1": True}, {"c1": "2"}, [1]])
def test_a_global_whose_counted_updates_do_not_fit_its_participants_is_refused(counted):
    m = msgpack.unpackb(codec.encode(GlobalModel(7, {"w": np.eye(2, dtype=np.float32)},
                                                 ("c1", "c2")), fleet=FLEET))
    m["counted"] = counted
    with pytest.raises(CodecError) as e:
        codec.decode(msgpack.packb(m), FLEET)
    assert e.value.reason == "malformed"


def test_tick_global_and_dict_messages_round_trip() -> None:
    tick = codec.decode(codec.encode(Tick("c1", 4, 1, 9), fleet=FLEET), FLEET)
    assert tick == Tick("c1", 4, 1, 9)
    g = GlobalModel(7, {"w": np.eye(2, dtype=np.float32)}, ("c1", "c2"))
    payload = codec.encode(g, fleet=FLEET)
    assert msgpack.unpackb(payload)["sender"] == "aggregator"
    dg = codec.decode(payload, FLEET)
    assert dg.version == 7 and dg.participants == ("c1", "c2") and dg.counted == {}
    counted = GlobalModel(8, g.tensors, ("c1", "c2"), counted={"c1": 3, "c2": 5})
    assert codec.decode(codec.encode(counted, fleet=FLEET), FLEET).counted == {"c1": 3, "c2": 5}
    _same_tensors(dg.tensors, g.tensors)
    cfg = Message("config", {"burn_in": 4, "q": 2, "mode": "sync", "spec": "abc"}, sender="agg")
    dc = codec.decode(codec.encode(cfg, fleet=FLEET), FLEET)
    assert dc == Message("config", cfg.body, FLEET, "agg")
    st_msg = Message("status", {"state": "online", "counts": {"sent": np.int64(3)}}, sender="c1")
    assert codec.decode(codec.encode(st_msg, fleet=FLEET), FLEET).body["counts"] == {"sent": 3}
    ctl = codec.decode(codec.encode(Message("control", {"command": "pause"}, sender="op"),
                                    fleet=FLEET), FLEET)
    assert ctl.kind == "control" and ctl.body == {"command": "pause"} and ctl.sender == "op"


def test_stream_batch_round_trip() -> None:
    b = Batch(np.random.default_rng(0).random((3, 1, 4, 4), dtype=np.float32),
              np.array([2, 0, 1], np.int64), task=1, index=5, end_of_task=True)
    msg = codec.decode(codec.encode_batch(b, client="c1", fleet=FLEET), FLEET)
    assert msg.kind == "stream" and msg.body["client"] == "c1" and msg.sender == "replayer"
    got = codec.as_batch(msg)
    np.testing.assert_array_equal(got.x, b.x)
    np.testing.assert_array_equal(got.y, b.y)
    assert (got.task, got.index, got.end_of_task) == (1, 5, True)


# ---------------------------------------------------------------- rejections


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_is_rejected(data: bytes) -> None:
    with pytest.raises(CodecError):
        codec.decode(data, FLEET)


@settings(max_examples=60, deadline=None)
@given(updates(), st.data())
def test_truncated_payloads_are_rejected(up: Update, data: st.DataObject) -> None:
    payload = codec.encode(up, fleet=FLEET)
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert _reason(payload[:cut], expect_fleet=FLEET) == "malformed"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.float64])
def test_nonfinite_tensors_are_rejected(bad: float, dt: type) -> None:
    w = np.ones((2, 3), dt)
    w[1, 2] = bad
    up = Update("c", 0, 1, 0, 1, 5, {"ok": np.ones(2, np.float32), "w": w})
    with pytest.raises(CodecError, match="'w'") as e:
        codec.decode(codec.encode(up, fleet=FLEET), FLEET)
    assert e.value.reason == "nonfinite"


def test_envelope_checks() -> None:
    good = _raw()
    assert codec.decode(good, FLEET) == Tick("c", 1, 0, 2)
    assert codec.decode(good, None) == Tick("c", 1, 0, 2)  # no fleet check requested
    assert _reason(good, expect_fleet="other") == "fleet"
    assert _reason(_raw(schema=2), expect_fleet=FLEET) == "schema"
    assert _reason(_raw(schema=...), expect_fleet=FLEET) == "schema"
    assert _reason(_raw(schema="1"), expect_fleet=FLEET) == "schema"
    assert _reason(_raw(kind="nonsense"), expect_fleet=FLEET) == "kind"
    assert _reason(_raw(sender=3), expect_fleet=FLEET) == "malformed"
    assert _reason(_raw(seq=True), expect_fleet=FLEET) == "malformed"  # bool is not an int
    assert _reason(_raw(seq=1.5), expect_fleet=FLEET) == "malformed"
    assert _reason(msgpack.packb([1, 2]), expect_fleet=FLEET) == "malformed"
    assert _reason(good, expect_fleet=FLEET, max_bytes=len(good) - 1) == "oversized"
    assert codec.decode(good, FLEET, max_bytes=len(good)) == Tick("c", 1, 0, 2)


def _update_with(tensor: dict) -> bytes:
    m = msgpack.unpackb(codec.encode(Update("c", 0, 1, 0, 1, 5, {"w": np.zeros(2, np.float32)}),
                                     fleet=FLEET))
    m["tensors"]["w"] = tensor
    del m["digest"]  # edited by hand: the sealed digest no longer applies
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        ({"dtype": "<f4", "shape": [3], "data": bytes(8)}, "shape"),  # 8 bytes != 3 * 4
        ({"dtype": "<f4", "shape": [2, -1], "data": bytes(8)}, "shape"),
        ({"dtype": "<f4", "shape": "2", "data": bytes(8)}, "shape"),
        ({"dtype": "<c8", "shape": [1], "data": bytes(8)}, "dtype"),
        ({"dtype": ">f4", "shape": [2], "data": bytes(8)}, "dtype"),  # big-endian never sent
        ({"dtype": "<f4", "shape": [2], "data": "text"}, "malformed"),
        ({"dtype": "<f4", "shape": [2]}, "malformed"),
        ({"dtype": "<f2", "shape": [4], "data": bytes(8), "to": "<i8"}, "dtype"),
    ],
)
def test_bad_tensors_are_rejected(tensor: dict, reason: str) -> None:
    assert _reason(_update_with(tensor), expect_fleet=FLEET) == reason


def test_good_hand_built_tensor_decodes() -> None:
    raw = np.array([1.5, -2.0], "<f4").tobytes()
    dec = codec.decode(_update_with({"dtype": "<f4", "shape": [2], "data": raw}), FLEET)
    np.testing.assert_array_equal(dec.tensors["w"], [1.5, -2.0])


def test_bad_messages_are_rejected() -> None:
    ctl = codec.encode(Message("control", {"command": "reboot"}, sender="op"), fleet=FLEET)
    assert _reason(ctl, expect_fleet=FLEET) == "malformed"
    with pytest.raises(CodecError, match="reserved"):
        codec.encode(Message("status", {"fleet": "x"}, sender="c"), fleet=FLEET)
    with pytest.raises(CodecError) as e:
        codec.encode(Message("gossip", {}, sender="c"), fleet=FLEET)
    assert e.value.reason == "kind"
    bad_batch = Batch(np.zeros((3, 2), np.float32), np.zeros(2, np.int64), 0, 1, False)
    assert _reason(codec.encode_batch(bad_batch, client="c", fleet=FLEET)) == "shape"
    with pytest.raises(CodecError) as e:
        codec.encode(Update("c", 0, 1, 0, 1, 5, {"w": np.zeros(2, np.complex64)}), fleet=FLEET)
    assert e.value.reason == "dtype"
    chunk = split(bytes(5000), 1024, "id")[0]
    assert _reason(chunk, expect_fleet=FLEET) == "kind"


# ---------------------------------------------------------------- model spec


def test_tensor_spec_hash_and_check() -> None:
    t = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    spec = tensor_spec(t)
    assert spec == {"w": ((4, 3), "<f4"), "b": ((3,), "<f4")}
    h = spec_hash(spec)
    assert len(h) == 16 and int(h, 16) >= 0
    assert spec_hash({"b": spec["b"], "w": spec["w"]}) == h  # order does not matter
    assert spec_hash({**spec, "w": ((3, 4), "<f4")}) != h
    assert spec_hash({**spec, "w": ((4, 3), "<f2")}) != h
    check_tensors({"b": np.ones(3, np.float32), "w": np.ones((4, 3), np.float32)}, spec)
    cases = [
        ({"w": t["w"]}, "names"),
        ({**t, "extra": t["b"]}, "names"),
        ({**t, "w": np.zeros((3, 4), np.float32)}, "shape"),
        ({**t, "b": np.zeros(3, np.float64)}, "dtype"),
    ]
    for tensors, reason in cases:
        with pytest.raises(CodecError) as e:
            check_tensors(tensors, spec)
        assert e.value.reason == reason


# ---------------------------------------------------------------- chunks


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 20_000), st.integers(512, 4096), st.randoms(use_true_random=False))
def test_chunk_round_trip_any_order(size: int, chunk_size: int, rnd) -> None:
    payload = rnd.randbytes(size)
    parts = split(payload, chunk_size, "m1")
    if size <= chunk_size:
        assert parts == [payload]
        return
    assert len(parts) == math.ceil(size / (chunk_size - CHUNK_OVERHEAD))
    assert all(len(p) <= chunk_size and is_chunk(p) for p in parts)
    rnd.shuffle(parts)
    r = Reassembler()
    results = [r.add(p, source="t") for p in parts]
    assert results[:-1] == [None] * (len(parts) - 1) and results[-1] == payload
    assert r.pending == 0 and r.completed == 1
    assert r.add(parts[0], source="t") is None and r.pending == 0  # late redelivery ignored


def test_chunk_fields_and_duplicates() -> None:
    payload = bytes(range(256)) * 20  # 5120 bytes
    parts = split(payload, 1024, "abc")
    first = msgpack.unpackb(parts[0])
    assert first["kind"] == "chunk" and first["id"] == "abc" and first["count"] == 7
    assert first["digest"] == hashlib.sha256(payload).digest() and first["size"] == 5120
    assert first["data"] == payload[:768]  # 1024 - 256 bytes of data per chunk
    r = Reassembler()
    for p in parts[:-1]:
        assert r.add(p) is None
        assert r.add(p) is None  # a QoS 1 duplicate changes nothing
    assert r.add(parts[-1]) == payload


def test_interleaved_transfers_and_sources() -> None:
    a, b = b"a" * 3000, b"b" * 3000
    pa, pb = split(a, 1024, "same-id"), split(b, 1024, "same-id")
    r = Reassembler()
    out = []
    for x, y in zip(pa, pb, strict=True):
        out += [r.add(x, source="topic/a"), r.add(y, source="topic/b")]
    assert [o for o in out if o is not None] == [a, b]


def test_corrupted_chunk_fails_digest() -> None:
    payload = bytes(range(256)) * 20
    parts = split(payload, 1024, "x")
    m = msgpack.unpackb(parts[2])
    m["data"] = bytes([m["data"][0] ^ 1]) + m["data"][1:]
    parts[2] = msgpack.packb(m, use_bin_type=True)
    r = Reassembler()
    with pytest.raises(CodecError) as e:
        for p in parts:
            r.add(p)
    assert e.value.reason == "digest" and r.pending == 0


def test_reassembler_limits() -> None:
    now = [0.0]
    r = Reassembler(max_bytes=10_000, max_pending=2, timeout_s=5.0, clock=lambda: now[0])
    ids = [split(bytes(3000), 1024, f"m{i}") for i in range(3)]
    for parts in ids:
        r.add(parts[0])
    assert r.pending == 2 and r.dropped == 1  # the oldest transfer was dropped
    now[0] = 6.0
    r.add(ids[2][1])  # activity on m2 after the timeout: m1 expires, m2 restarts
    assert r.pending == 1 and r.dropped == 3
    big = split(bytes(20_000), 1024, "big")
    with pytest.raises(CodecError) as e:
        r.add(big[0])
    assert e.value.reason == "oversized"
    assert [r.add(p) for p in big[1:]] == [None] * (len(big) - 1)  # rejected once per transfer
    with pytest.raises(CodecError):
        r.add(b"\x93\x01\x02\x03")
    parts = split(bytes(3000), 1024, "mix")
    other = msgpack.unpackb(split(bytes(4000), 1024, "mix")[1])
    r.add(parts[0])
    with pytest.raises(CodecError, match="disagrees"):
        r.add(msgpack.packb(other, use_bin_type=True))


def test_split_arguments() -> None:
    with pytest.raises(ValueError, match="at least"):
        split(b"x" * 100, 100, "id")
    with pytest.raises(ValueError, match="msg_id"):
        split(b"x" * 5000, 1024, "")
    assert chunks.DEFAULT_CHUNK_SIZE == 1024 * 1024


# ---------------------------------------------------------------- topics


def test_topics() -> None:
    t = Topics("fleet-a")
    assert t.config == "edgefcl/fleet-a/config" and t.global_ == "edgefcl/fleet-a/global"
    assert t.tick == "edgefcl/fleet-a/tick" and t.control == "edgefcl/fleet-a/control"
    assert t.aggregator_status == "edgefcl/fleet-a/aggregator/status"
    assert t.update("c1") == "edgefcl/fleet-a/update/c1" and t.updates == "edgefcl/fleet-a/update/+"
    assert t.status("c1") == "edgefcl/fleet-a/status/c1" and t.statuses.endswith("status/+")
    assert t.stream("c1") == "edgefcl/fleet-a/stream/c1"
    assert Topics("f", root="org/lab").update("c") == "org/lab/f/update/c"
    assert t.client_from("edgefcl/fleet-a/update/c7") == "c7"
    assert t.client_from(t.status("dev.9")) == "dev.9"
    for bad_topic in ["edgefcl/other/update/c1", "edgefcl/fleet-a/global",
                      "edgefcl/fleet-a/update/c1/x", "edgefcl/fleet-a/update/"]:
        with pytest.raises(ValueError):
            t.client_from(bad_topic)
    for bad in ["", "a/b", "a+", "#", "$SYS", "x" * 200]:
        with pytest.raises(ValueError, match="fleet id"):
            Topics(bad)
        with pytest.raises(ValueError, match="client id"):
            t.update(bad)
    with pytest.raises(ValueError, match="root"):
        Topics("f", root="/edgefcl")


# ---------------------------------------------------------------- fuzzing the fields

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=3),
    max_leaves=8,
)
_GOOD = {
    "update": codec.encode(Update("c", 1, 2, 0, 3, 4, {"w": np.ones((2, 2), np.float32)},
                                  class_counts={1: 2}), fleet=FLEET, wire_dtype="<f2"),
    "global": codec.encode(GlobalModel(3, {"w": np.ones(2, np.float32)}, ("c",)), fleet=FLEET),
    "stream": codec.encode_batch(Batch(np.ones((2, 3), np.float32), np.zeros(2, np.int64), 0,
                                       1, False), client="c", fleet=FLEET),
    "control": codec.encode(Message("control", {"command": "stop"}, sender="op"), fleet=FLEET),
}


def _paths(obj, prefix=()):
    """Every key path of nested maps."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(_GOOD)), st.data(), msgpack_values)
def test_any_field_replaced_by_junk_is_decoded_or_rejected_cleanly(
    kind: str, data: st.DataObject, junk
) -> None:
    m = msgpack.unpackb(_GOOD[kind], strict_map_key=False)
    path = data.draw(st.sampled_from(list(_paths(m))))
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = junk
    try:
        payload = msgpack.packb(m, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    with contextlib.suppress(CodecError):  # any other exception type fails the test
        codec.decode(payload, FLEET)


def test_noncontiguous_and_big_endian_arrays_encode() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensors = {"t": base.T, "be": base.astype(">f4"), "s": base[:, ::2], "i": np.int64(7) * 1}
    tensors["i"] = np.asarray(tensors["i"])
    dec = codec.decode(codec.encode(Update("c", 0, 1, 0, 1, 5, tensors), fleet=FLEET), FLEET)
    np.testing.assert_array_equal(dec.tensors["t"], base.T)
    np.testing.assert_array_equal(dec.tensors["be"], base)
    assert dec.tensors["be"].dtype == np.dtype("<f4") and dec.tensors["t"].flags.c_contiguous
    np.testing.assert_array_equal(dec.tensors["s"], base[:, ::2])
    assert dec.tensors["i"].shape == () and dec.tensors["i"] == 7


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["schema", "kind", "id", "index", "count", "size", "digest", "data"]),
       msgpack_values)
def test_chunk_with_junk_field_is_rejected_cleanly(key: str, junk) -> None:
    parts = split(bytes(range(256)) * 10, 1024, "j")
    m = msgpack.unpackb(parts[1])
    m[key] = junk
    r = Reassembler()
    r.add(parts[0])
    try:
        got = r.add(msgpack.packb(m, use_bin_type=True))
    except CodecError:
        return
    assert got is None  # accepted only if still a plausible chunk; never a wrong payload


def test_one_table_names_every_kind_its_topic_and_form():
    """`transport/kinds.py` is the one home of message kinds: the codec decodes every form of
    the table, carries exactly its map kinds as Messages, and the topics accept on each
    per-client topic exactly the table's kinds for it."""
    from edgefcl.transport.kinds import KINDS, MAP_KINDS, kinds_on
    from edgefcl.transport.topics import CONTROL_KINDS, TOPIC_KINDS

    assert {k.form for k in KINDS.values()} - {"chunk"} == set(codec._DECODERS)
    expected = {"update": {"update", "tick"}, "status": {"status"}, "stream": {"stream"}}
    assert expected == TOPIC_KINDS
    assert CONTROL_KINDS == kinds_on("control") == {"control"}
    for kind in MAP_KINDS - {"stream", "answer", "control"}:  # those need their fields
        msg = codec.decode(codec.encode(Message(kind, {"a": 1}), fleet="f", sender="s"))
        assert isinstance(msg, Message) and msg.kind == kind and msg.body == {"a": 1}
    with pytest.raises(CodecError, match="unknown"):
        codec.encode(Message("nope", {}), fleet="f", sender="s")


def test_a_global_names_its_run():
    from dataclasses import replace

    g = GlobalModel(3, {"w": np.zeros(2, np.float32)}, run="3f9a")
    assert codec.decode(codec.encode(g, fleet="f"), "f").run == "3f9a"
    plain = GlobalModel(3, {"w": np.zeros(2, np.float32)})
    assert codec.decode(codec.encode(plain, fleet="f"), "f").run is None
    for bad in ("", "x" * 65):
        with pytest.raises(CodecError, match="run must be"):
            codec.decode(codec.encode(replace(g, run=bad), fleet="f"), "f")
