"""Attacks on the wire decoder: payloads built to exhaust the stack, memory or time of the
receiver must be rejected with a reason before anything large is allocated."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.federation.messages import Update
from edgefcl.transport import codec
from edgefcl.transport.bounds import Limits, scan
from edgefcl.transport.codec import CodecError

FLEET = "f"


def _reason(payload: bytes, **kw) -> str:
    with pytest.raises(CodecError) as e:
        codec.decode(payload, FLEET, **kw)
    return e.value.reason


def _envelope(**extra) -> dict:
    return {"schema": 1, "kind": "status", "fleet": FLEET, "sender": "c", **extra}


def test_deeply_nested_map_is_rejected_not_a_recursion_error() -> None:
    inner: dict = {"state": "online"}
    for _ in range(500):
        inner = {"x": inner}
    payload = msgpack.packb(_envelope(extra=inner))
    assert _reason(payload) == "limits"
    # just inside the limit decodes
    ok = msgpack.packb(_envelope(a={"b": {"c": [1, 2]}}))
    assert codec.decode(ok, FLEET).body["a"] == {"b": {"c": [1, 2]}}


def test_many_zero_size_tensors_are_rejected_before_allocation() -> None:
    tensor = {"dtype": "<f4", "shape": [0], "data": b""}
    m = {"schema": 1, "kind": "update", "fleet": FLEET, "sender": "c", "client": "c",
         "base_version": 0, "seq": 1, "task": 0, "batch": 1, "num_samples": 1,
         "encoding": "dense", "class_counts": None,
         "tensors": {f"t{i}": tensor for i in range(200_000)}}
    payload = msgpack.packb(m, use_bin_type=True)
    tracemalloc.start()
    t0 = time.perf_counter()
    assert _reason(payload) == "limits"
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak  # nothing proportional to the declared objects
    assert elapsed < 5  # generous: the bound is the object limit, not the payload size


def test_declared_sizes_beyond_the_payload_are_malformed() -> None:
    assert _reason(b"\xdf\xff\xff\xff\xff") == "malformed"  # map32 of 4G entries, no bytes
    assert _reason(b"\xc6\x7f\xff\xff\xff" + b"x") == "malformed"  # bin32 of 2 GiB
    assert _reason(msgpack.packb(_envelope()) + b"\x00") == "malformed"  # trailing bytes
    assert _reason(b"\xc1") == "malformed"


def test_tensor_count_limit() -> None:
    tensors = {f"t{i}": np.zeros(1, np.float32) for i in range(10)}
    payload = codec.encode(Update("c", 0, 1, 0, 1, 1, tensors), fleet=FLEET)
    assert _reason(payload, limits=Limits(max_tensors=9)) == "limits"
    assert len(codec.decode(payload, FLEET, limits=Limits(max_tensors=10)).tensors) == 10


def test_digest_is_checked_before_decoding() -> None:
    good = codec.encode(Update("c", 0, 1, 0, 1, 1, {"w": np.ones(2, np.float32)}), fleet=FLEET)
    flipped = bytearray(good)
    flipped[-20] ^= 0xFF  # inside the digest trailer's prefix region or data: digest fails
    assert _reason(bytes(flipped), require_digest=True) in ("digest", "malformed")


def test_the_digest_is_sha256_truncated_and_an_older_blake2b_seal_is_named() -> None:
    import hashlib

    good = codec.encode(Update("c", 0, 1, 0, 1, 1, {"w": np.ones(2, np.float32)}), fleet=FLEET)
    body, digest = good[:-16], good[-16:]
    assert digest == hashlib.sha256(body).digest()[:16]  # by hand
    # a payload sealed by a build before SHA-256 (BLAKE2b-128) is rejected as a digest
    # mismatch that says to update the sender, not as damaged bytes
    old = body + hashlib.blake2b(body, digest_size=16).digest()
    with pytest.raises(CodecError, match="older edgefcl build") as e:
        codec.decode(old, FLEET, require_digest=True)
    assert e.value.reason == "digest"
    damaged = bytearray(good)
    damaged[-1] ^= 1
    with pytest.raises(CodecError, match="damaged") as e:
        codec.decode(bytes(damaged), FLEET, require_digest=True)
    assert e.value.reason == "digest"


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.binary(max_size=8)
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
    max_leaves=60))
def test_scan_agrees_with_msgpack_on_what_is_well_formed(obj) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    try:
        scan(payload, Limits(max_depth=64, max_objects=10_000))
    except CodecError as e:
        assert e.reason == "limits"
    for cut in (1, len(payload) // 2):
        if cut < len(payload):
            with pytest.raises(CodecError):
                scan(payload[:cut])


def test_chunk_count_must_fit_the_declared_size() -> None:
    from edgefcl.transport.chunks import Reassembler, split
    m = msgpack.unpackb(split(bytes(3000), 1024, "x")[0])
    m["count"] = 10**9
    with pytest.raises(CodecError) as e:
        Reassembler().add(msgpack.packb(m, use_bin_type=True))
    assert e.value.reason == "limits"


def test_one_sender_cannot_evict_another_and_idle_transfers_expire() -> None:
    from edgefcl.transport.chunks import Reassembler, split
    now = [0.0]
    r = Reassembler(max_pending=8, max_per_source=2, timeout_s=5.0, clock=lambda: now[0])
    honest = split(bytes(3000), 1024, "h")
    r.add(honest[0], source="update/honest")
    for i in range(50):  # a flood of transfers from one source
        r.add(split(bytes(3000), 1024, f"f{i}")[0], source="update/attacker")
    assert r.pending == 3 and r.dropped == 48
    assert [r.add(p, source="update/honest") for p in honest[1:]][-1] == bytes(3000)
    now[0] = 10.0
    assert r.expire() == 2 and r.pending == 0 and r.pending_bytes == 0


def test_pending_bytes_are_bounded_and_the_biggest_holder_pays() -> None:
    from edgefcl.transport.chunks import Reassembler, split
    r = Reassembler(max_bytes=10_000, max_pending=16, max_per_source=4,
                    max_pending_bytes=12_000)
    honest = split(bytes(range(256)) * 20, 1024, "h")  # 5120 bytes
    r.add(honest[0], source="honest")
    for i in range(4):  # the attacker opens transfers of 9000 bytes and sends most of each
        parts = split(bytes(9000), 1024, f"a{i}")
        for p in parts[:-1]:
            r.add(p, source="attacker")
    assert r.pending_bytes <= 12_000
    got = [r.add(p, source="honest") for p in honest[1:]]
    assert got[-1] == bytes(range(256)) * 20


def _chunk_with_id(id_bytes: bytes) -> bytes:
    """A chunk message whose "id" is any msgpack object (the rest well formed)."""
    from edgefcl.transport.chunks import _PREFIX
    rest = {"index": 0, "count": 1, "size": 1, "digest": b"0" * 32, "data": b"x"}
    return (_PREFIX + msgpack.packb("id") + id_bytes
            + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in rest.items()))


def test_a_chunk_of_millions_of_objects_is_refused_before_it_is_unpacked() -> None:
    """A chunk message went to msgpack.unpackb unscanned, on the network thread, holding the
    link's lock: an "id" of 4 million empty arrays took 2.8 s and 285 MiB there."""
    from edgefcl.transport.chunks import Reassembler

    n = 4_000_000
    bomb = _chunk_with_id(b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
    r = Reassembler(max_bytes=8 << 20)
    tracemalloc.start()
    with pytest.raises(CodecError) as err:
        r.add(bomb, source="edgefcl/t/update/evil")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert err.value.reason == "limits" and peak < 16 << 20, peak
    nested = _chunk_with_id(b"\x91" * 3 + b"\xa1a")  # "id": [[["a"]]]: not a chunk's shape
    with pytest.raises(CodecError, match="limits|malformed"):
        r.add(nested, source="edgefcl/t/update/evil")


def test_a_chunk_larger_than_the_whole_payload_limit_is_refused_by_its_size() -> None:
    from edgefcl.transport.chunks import CHUNK_OVERHEAD, Reassembler, split

    r = Reassembler(max_bytes=4_000)
    ok = split(bytes(5_000), 4_000 + CHUNK_OVERHEAD, "ok")  # one chunk of the limit's size
    with pytest.raises(CodecError, match="oversized"):  # 5,000 > 4,000 by the declared size
        r.add(ok[0], source="a")
    big = msgpack.packb({"schema": 1, "kind": "chunk", "id": "big", "index": 0, "count": 2,
                         "size": 2_000, "digest": b"0" * 32, "data": bytes(1 << 20)})
    with pytest.raises(CodecError, match="oversized"):  # the message itself is too big
        r.add(big, source="a")
