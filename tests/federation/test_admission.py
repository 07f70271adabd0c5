"""Attacks on admission: no single device can outweigh the fleet or lock others out."""

from __future__ import annotations

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Tick, Update

ZERO = {"w": np.zeros(2, np.float32)}


def upd(client, value=1.0, n=16, seq=1, batch=2, base=0, task=0, classes=None):
    return Update(client, base, seq, task, batch, n, {"w": np.full(2, value, np.float32)},
                  class_counts=classes)


def make(mode="async", **kw) -> Aggregator:
    fed = FedConfig(**{"clients": 3, "burn_in": 0, "jump": 2, "mode": mode, "min_clients": 2,
                       "round_timeout": 1.0, **kw})
    return Aggregator(dict(ZERO), fed, batch_size=8)


def rejected(agg: Aggregator, msg, reason: str) -> bool:
    before = agg.counters[f"rejected_{reason}"]
    agg.submit(msg, now=0.0)
    return agg.counters[f"rejected_{reason}"] == before + 1


def test_sample_count_is_bounded_by_what_the_device_can_have_seen() -> None:
    agg = make()
    assert rejected(agg, upd("a", n=10**12), "samples")
    assert rejected(agg, upd("a", n=17, batch=2), "samples")  # 2 batches x 8 = 16
    assert agg.submit(upd("a", n=16, batch=2)) is None and agg.counters["accepted"] == 1
    capped = make(sample_cap=5)
    assert rejected(capped, upd("a", n=6), "samples")


def test_class_counts_must_add_up_and_be_positive() -> None:
    agg = make()
    assert rejected(agg, upd("a", n=16, classes={0: 0}), "classes")
    assert rejected(agg, upd("a", n=16, classes={i: 1 for i in range(1000)}), "classes")
    assert rejected(agg, upd("a", n=16, classes={0: 10}), "classes")
    assert rejected(agg, upd("a", n=16, classes={-1: 16}), "classes")
    agg.submit(upd("a", n=16, classes={0: 6, 3: 10}))
    assert agg.counters["accepted"] == 1


def test_one_client_cannot_fill_the_quorum_alone() -> None:
    agg = make(clip_factor=0.0)  # 7 against 1: clipping at 3 x the lower norm would bind
    agg.submit(upd("c9", 5.0, seq=1, batch=2), now=0.0)
    agg.submit(upd("c9", 7.0, seq=2, batch=4), now=0.1)
    assert agg.poll(now=5.0) is None and agg.global_.version == 0
    assert agg.counters["replaced"] == 1
    closed = agg.submit(upd("c1", 1.0), now=5.1)
    closed = closed or agg.poll(now=10.0)
    assert closed.participants == ("c1", "c9")
    # c9's newer update (7.0) replaced its first one: (7 + 1) / 2 mixed 0.5 with zero
    np.testing.assert_allclose(closed.global_.tensors["w"], [2.0, 2.0])


def test_base_version_ahead_is_rejected_in_both_modes() -> None:
    assert rejected(make(), upd("a", base=10**9), "base")
    assert rejected(make("sync"), upd("a", base=10**9), "base")


def test_a_huge_sequence_number_cannot_lock_a_client_out() -> None:
    agg = make()
    assert rejected(agg, upd("a", seq=2**64 - 1), "seq")
    agg.submit(upd("a", seq=1), now=0.0)
    assert rejected(agg, upd("a", seq=1 + 100_001, batch=4), "seq")
    agg.submit(upd("a", seq=2, batch=4), now=0.0)
    assert agg.counters["accepted"] == 2


def test_an_old_update_resent_with_a_new_seq_is_a_replay() -> None:
    agg = make()
    agg.submit(upd("a", seq=2, batch=4), now=0.0)
    assert rejected(agg, upd("a", seq=3, batch=4), "replay")
    assert rejected(agg, upd("a", seq=4, batch=2), "replay")
    agg.submit(upd("a", seq=5, batch=2, task=1), now=0.0)  # a new task starts again
    assert agg.counters["accepted"] == 2


def test_a_batch_beyond_what_the_seq_allows_is_rejected() -> None:
    assert rejected(make(), upd("a", seq=1, batch=10**6, n=1), "batch")


def test_ghost_ids_cannot_join_a_full_learned_roster() -> None:
    agg = make(clients=2)
    agg.submit(upd("a"), now=0.0)
    agg.submit(upd("b", seq=1), now=0.0)  # round closes, roster full (a, b)
    for i in range(50):
        assert rejected(agg, upd(f"ghost{i}"), "roster")
    assert not agg.join("ghost-online") and agg.active == {"a", "b"}


def test_configured_roster_admits_only_its_clients() -> None:
    agg = make(roster="a,b,c")
    assert rejected(agg, upd("x"), "roster")
    assert agg.join("c") and not agg.join("x")


def test_sync_waits_only_for_roster_clients_and_not_for_silent_ones() -> None:
    agg = make("sync", clients=2, client_timeout=10.0, burn_in=0, jump=1)
    agg.join("a", now=0.0)
    agg.join("b", now=0.0)
    assert not agg.join("ghost", now=0.0)  # a ghost "online" status does not stall the ticks
    agg.submit(Tick("a", 1, 0, 1), now=1.0)
    closed = agg.submit(Tick("b", 1, 0, 1), now=1.0)
    assert closed is not None and closed.tick == 1
    agg.submit(Tick("a", 2, 0, 2), now=2.0)  # b falls silent
    assert agg.expire(now=5.0) is None and "b" in agg.active
    closed = agg.expire(now=11.5)
    assert closed is not None and closed.tick == 2 and agg.active == {"a"}
    assert agg.counters["silent_left"] == 1
