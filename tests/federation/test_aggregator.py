import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Tick, Update
from edgefcl.federation.schedule import eligible, nth_eligible
from edgefcl.federation.strategy import ClassWeightedFedAvg, FedAvg, WeightedSum, mix


def upd(client, value, n=10, seq=1, batch=4, base=0, classes=None, shape=(2,)):
    return Update(client, base, seq, 0, batch, n, {"w": np.full(shape, value, np.float32)},
                  class_counts=classes)


def test_schedule_burn_in_and_jump():
    got = [b for b in range(1, 16) if eligible(b, burn_in=5, jump=3)]
    assert got == [6, 9, 12, 15]
    assert [b for b in range(1, 6) if eligible(b, 0, 2)] == [2, 4]
    assert [nth_eligible(n, 5, 3) for n in (1, 2, 3)] == [6, 9, 12]
    assert [nth_eligible(n, 3, 2) for n in (1, 2)] == [4, 6]  # burn-in not a multiple of jump
    assert [nth_eligible(n, 0, 1) for n in (1, 2)] == [1, 2]


@given(st.integers(1, 50), st.integers(0, 40), st.integers(1, 10))
def test_the_nth_eligible_batch_is_eligible_and_admitted(n, burn_in, jump):
    b = nth_eligible(n, burn_in, jump)
    assert eligible(b, burn_in, jump)
    assert sum(eligible(k, burn_in, jump) for k in range(1, b + 1)) == n  # the n-th one
    assert b <= burn_in + jump * n  # within admission's bound for sequence number n


ZERO = {"w": np.zeros(2, np.float32)}


def test_fedavg_weights_by_samples():
    s = FedAvg(FedConfig(mix=1.0), {})
    s.add(upd("a", 1.0, n=10))
    s.add(upd("b", 4.0, n=30))
    np.testing.assert_allclose(s.result(ZERO)["w"], [(10 * 1 + 30 * 4) / 40] * 2)


def test_class_weighted_fedavg_by_hand():
    s = ClassWeightedFedAvg(FedConfig(mix=1.0), {})
    s.add(upd("a", 0.0, classes={0: 10, 1: 10}))
    s.add(upd("b", 6.0, classes={1: 30}))
    # class 0: only a -> 0; class 1: (10*0 + 30*6)/40 = 4.5; equal mean of classes -> 2.25
    np.testing.assert_allclose(s.result(ZERO)["w"], [2.25, 2.25])


def test_class_weighted_keeps_a_model_for_at_most_max_round_classes(monkeypatch):
    # class ids are claims: past the maximum a round's further classes share class -1
    import edgefcl.federation.strategy as strategy

    monkeypatch.setattr(strategy, "MAX_ROUND_CLASSES", 2)
    s = ClassWeightedFedAvg(FedConfig(mix=1.0), {})
    s.add(upd("a", 1.0, classes={0: 10}))
    s.add(upd("b", 2.0, classes={1: 10}))
    s.add(upd("c", 3.0, classes={2: 10}))
    s.add(upd("d", 5.0, classes={3: 10}))
    # classes 0 -> 1, 1 -> 2, the folded 2 and 3 -> (3 + 5) / 2 = 4; mean (1 + 2 + 4) / 3
    np.testing.assert_allclose(s.result(ZERO)["w"], [7 / 3, 7 / 3], rtol=1e-6)
    assert s.counters()["classes_folded"] == 2


def test_mix_with_previous_global():
    out = mix({"w": np.array([2.0])}, {"w": np.array([0.0], np.float32)}, 0.5)
    assert out["w"].dtype == np.float32 and out["w"][0] == 1.0


def test_weighted_sum_memory_does_not_grow():
    s = WeightedSum()
    for i in range(50):
        s.add({"w": np.full(3, i, np.float32)}, 1.0)
    assert len(s.sums) == 1 and s.sums["w"].shape == (3,)
    np.testing.assert_allclose(s.mean()["w"], np.full(3, 24.5))


def make(mode="sync", **kw):
    fed = FedConfig(**({"clients": 3, "burn_in": 2, "jump": 2, "mode": mode} | kw))
    return Aggregator({"w": np.zeros(2, np.float32)}, fed)


def test_sync_tick_closes_when_everyone_reported_and_mixes():
    agg = make(max_share=1.0)  # sample-weighted: with the default cap two updates weigh alike
    assert agg.submit(upd("a", 2.0, n=10)) is None
    assert agg.submit(Tick("b", 1, 0, 4)) is None
    closed = agg.submit(upd("c", 4.0, n=30))
    assert closed.tick == 1 and closed.participants == ("a", "c")
    # FedAvg (10*2 + 30*4)/40 = 3.5, mixed 0.5/0.5 with the zero global -> 1.75
    np.testing.assert_allclose(closed.global_.tensors["w"], [1.75, 1.75])
    assert agg.global_.version == 1 and agg.rounds == 1


def test_sync_tick_without_quorum_is_answered_without_a_global():
    agg = make()
    agg.submit(upd("a", 2.0))
    agg.submit(Tick("b", 1, 0, 4))
    closed = agg.submit(Tick("c", 1, 0, 4))
    assert closed.tick == 1 and closed.global_ is None and agg.global_.version == 0


def test_sync_result_independent_of_arrival_order():
    results = []
    for order in (["a", "b", "c"], ["c", "a", "b"]):
        agg = make()
        vals = {"a": 0.1, "b": 0.7, "c": 1.3}
        for cid in order:
            closed = agg.submit(upd(cid, vals[cid], n=7 + ord(cid)))
        results.append(closed.global_.tensors["w"].tobytes())
    assert results[0] == results[1]


def test_leaving_client_does_not_stall_tick():
    agg = make()
    for cid in "abc":
        agg.join(cid)
    agg.submit(upd("a", 1.0))
    agg.submit(upd("b", 3.0))
    closed = agg.leave("c")
    assert closed is not None and closed.global_ is not None


@pytest.mark.parametrize("bad,reason", [
    (Update("a", 0, 1, 0, 4, 10, {"v": np.zeros(2, np.float32)}), "names"),
    (Update("a", 0, 1, 0, 4, 10, {"w": np.zeros(3, np.float32)}), "shape"),
    (Update("a", 0, 1, 0, 4, 10, {"w": np.zeros(2, np.float64)}), "dtype"),
    (Update("a", 0, 1, 0, 4, 10, {"w": np.array([0, np.nan], np.float32)}), "nonfinite"),
    (Update("a", 0, 1, 0, 4, 10, {"w": np.array([2e6, -np.inf], np.float32)}), "nonfinite"),
    (Update("a", 0, 1, 0, 4, 10, {"w": np.array([0, -2e6], np.float32)}), "range"),
    (Update("a", 0, 1, 0, 1, 10, {"w": np.zeros(2, np.float32)}), "not-eligible"),
    (Update("a", 0, 1, 0, 3, 10, {"w": np.zeros(2, np.float32)}), "not-eligible"),
])
def test_invalid_updates_are_rejected_and_counted(bad, reason):
    agg = make()
    assert agg.submit(bad) is None
    assert agg.counters[f"rejected_{reason}"] == 1
    assert agg.counters["accepted"] == 0


def test_duplicates_are_dropped():
    agg = make()
    agg.submit(upd("a", 1.0, seq=1))
    agg.submit(upd("a", 1.0, seq=1))
    assert agg.counters["rejected_duplicate"] == 1


def test_async_round_closes_on_quorum_and_timeout_and_drops_stale():
    agg = make("async", round_timeout=1.0, max_staleness=1, min_clients=2)
    for cid in "abc":
        agg.join(cid)
    assert agg.submit(upd("a", 1.0), now=0.0) is None
    assert agg.submit(upd("b", 3.0), now=0.2) is None  # c has not reported, no timeout yet
    closed = agg.poll(now=1.5)
    assert closed is not None and closed.participants == ("a", "b")
    agg.submit(upd("a", 1.0, seq=2, base=1, batch=6), now=2)
    agg.submit(upd("b", 1.0, seq=2, base=1, batch=6), now=2)
    agg.submit(upd("c", 1.0, seq=1, base=1), now=2)
    assert agg.global_.version == 2
    assert agg.submit(upd("c", 1.0, seq=2, base=0, batch=6), now=3) is None
    assert agg.counters["rejected_stale"] == 1


def test_state_round_trip():
    agg = make()
    agg.submit(upd("a", 2.0))
    agg.submit(upd("b", 2.0))
    agg.submit(upd("c", 2.0))
    other = make()
    other.load_state(agg.state())
    assert other.global_.version == 1 and other.last_seq == {"a": 1, "b": 1, "c": 1}
    np.testing.assert_array_equal(other.global_.tensors["w"], agg.global_.tensors["w"])


@pytest.mark.parametrize("quorum, closes_on_attackers_alone", [(0.5, False), (0.0, True)])
def test_attackers_sending_first_cannot_close_an_async_round_alone(quorum,
                                                                   closes_on_attackers_alone):
    """min_clients attackers that report first used to own the round at the timeout; with
    `quorum` the timeout closes a round only once that share of the active clients reported
    (0 restores the count-only rule, shown as the attack that then works)."""
    agg = make("async", round_timeout=1.0, min_clients=2, quorum=quorum, clients=6)
    for cid in ("x1", "x2", "h1", "h2", "h3", "h4"):
        agg.join(cid, now=0.0)
    agg.submit(upd("x1", 100.0), now=0.0)
    agg.submit(upd("x2", 100.0), now=0.1)
    closed = agg.poll(now=1.5)  # the timeout passed with only the attackers in
    assert (closed is not None) == closes_on_attackers_alone
    if closes_on_attackers_alone:
        assert closed.participants == ("x1", "x2")
        return
    assert agg.submit(upd("h1", 1.0), now=1.6) is not None  # 3 of 6 active: the round closes
    assert agg.global_.participants == ("h1", "x1", "x2")


def test_the_quorum_shrinks_with_the_active_set():
    """Clients that leave (done, offline, silent) no longer count: the round still closes."""
    agg = make("async", round_timeout=1.0, min_clients=1, quorum=0.5, clients=4)
    for cid in "abcd":
        agg.join(cid, now=0.0)
    agg.submit(upd("a", 1.0), now=0.0)
    assert agg.poll(now=2.0) is None  # 1 of 4
    assert agg.leave("b", now=2.1) is None  # 1 of 3
    assert agg.leave("c", now=2.2) is not None  # 1 of 2


def test_a_large_fleet_closes_an_async_round_on_half_of_its_devices():
    """A round that waits for every one of 1,000 devices lasts a send period of the last one,
    and the others' newer updates replace theirs meanwhile (sparse at 2x over the broker:
    0.71-0.85 of capacity folded). With `buffer` 0, a fleet of 100 active devices or more
    closes a round once 50 updates came in; -1 turns it off; 99 devices wait for all."""
    def fleet(n, **kw):
        agg = make("async", round_timeout=100.0, min_clients=2, clients=n, max_share=1.0, **kw)
        for i in range(n):
            agg.join(f"d{i}", now=0.0)
        return agg

    agg = fleet(100)
    closed = [agg.submit(upd(f"d{i}", 1.0), now=0.1) for i in range(50)]
    assert closed[:49] == [None] * 49 and len(closed[49].participants) == 50
    assert agg.counters["closed_buffer"] == 1
    off = fleet(100, buffer=-1)
    assert all(off.submit(upd(f"d{i}", 1.0), now=0.1) is None for i in range(99))
    small = fleet(99)
    assert all(small.submit(upd(f"d{i}", 1.0), now=0.1) is None for i in range(98))
    assert small.submit(upd("d98", 1.0), now=0.1) is not None  # all 99 reported
    assert fleet(100, buffer=7).submit(upd("d0", 1.0), now=0.1) is None


def test_one_devices_resent_updates_cannot_close_a_buffered_round():
    """Attack: `buffer` counts a client's newer update that replaced its older (FedBuff's K),
    so one device resending 50 updates filled K = 51 of 102 active devices and closed a round
    of two, without the quorum; two such ids sending 50/s then owned 113 of 118 rounds in
    60 s (virtual) and took the global to their target. A buffered round now closes only
    with the quorum's clients in it (or K of them when that is fewer)."""
    agg = make("async", round_timeout=100.0, min_clients=2, clients=102, max_share=1.0,
               burn_in=0, jump=1)
    for i in range(101):
        agg.join(f"d{i}", now=0.0)
    agg.join("x", now=0.0)
    assert agg.submit(upd("d0", 1.0, batch=1), now=0.1) is None
    assert all(agg.submit(upd("x", -10.0, seq=s, batch=s), now=0.1) is None
               for s in range(1, 51))
    assert agg.counters["replaced"] == 49 and agg.rounds == 0
    closed = [agg.submit(upd(f"d{i}", 1.0, batch=1), now=0.2) for i in range(1, 50)]
    assert closed[:-1] == [None] * 48  # the 51st client in brings the quorum
    assert len(closed[-1].participants) == 51 and agg.counters["closed_buffer"] == 1

    few = make("async", round_timeout=100.0, min_clients=2, clients=100, buffer=3,
               burn_in=0, jump=1)
    for i in range(99):
        few.join(f"d{i}", now=0.0)
    few.join("x", now=0.0)
    assert all(few.submit(upd("x", -10.0, seq=s, batch=s), now=0.1) is None
               for s in range(1, 4))  # K = 3 updates, one client
    assert few.submit(upd("d0", 1.0, batch=1), now=0.1) is None  # 2 of the K = 3 clients
    assert few.submit(upd("d1", 1.0, batch=1), now=0.1).participants == ("d0", "d1", "x")


def test_ids_that_leave_after_sending_still_count_in_the_quorum():
    """Attack (a reviewer helper's): an update stays in the open round after its sender goes
    offline, while the quorum and K were shares of the active clients only: 50 ids that each
    sent an update and left closed a round of their own among 100 honest devices (99 that
    stayed active could not). The shares now count the round's clients too."""
    agg = make("async", round_timeout=100.0, min_clients=2, clients=300, max_share=1.0,
               burn_in=0, jump=1)
    for i in range(100):
        agg.join(f"h{i}", now=0.0)
    assert all(agg.submit(upd(f"x{j}", -10.0, batch=1), now=0.1) is None for j in range(50))
    assert all(agg.leave(f"x{j}", now=0.2) is None for j in range(50))
    assert agg.poll(now=200.0) is None  # timed out: 50 of the 150 is below the quorum
    closed = [agg.submit(upd(f"h{i}", 1.0, batch=1), now=200.1) for i in range(25)]
    assert closed[:-1] == [None] * 24 and len(closed[-1].participants) == 75


def test_colluding_ids_that_fill_the_round_buffer_do_not_close_a_round_of_their_own():
    """Attack (a reviewer helper's): a round that reached `round_max_mib` closed with
    `min_clients` clients, and a device picks its update's size (a sparse update of every
    entry is 40x an honest one): 57 colluding ids filled 64 MiB among 1,000 active devices and
    closed a round of their own. A full round of a rule that can spill now spills what it
    holds and waits for the quorum; here 6 ids fill a 48-byte buffer among 20 devices."""
    agg = make("async", round_timeout=100.0, min_clients=2, clients=30, max_share=1.0,
               burn_in=0, jump=1, round_max_mib=48 / 2**20)
    for i in range(20):
        agg.join(f"h{i}", now=0.0)
    assert agg.spills
    assert all(agg.submit(upd(f"x{j}", -10.0, batch=1), now=0.1) is None for j in range(6))
    assert agg.counters["spilled"] == 6 and agg.rounds == 0  # 6 of the 26: below the quorum
    assert all(agg.submit(upd(f"h{i}", 1.0, batch=1), now=0.2) is None for i in range(7))
    assert len(agg.poll(now=100.2).participants) == 13  # at the timeout, with the quorum


def test_a_full_async_round_closes_before_the_timeout():
    """`round_max_mib` bounds what an open round holds: 3 updates of 8 bytes reach a 24-byte
    buffer and close the round at once, with 6 active clients and no timeout; a replaced
    update is counted once."""
    agg = make("async", round_timeout=100.0, min_clients=2, quorum=0.5, clients=6,
               round_max_mib=24 / 2**20)
    for cid in "abcdef":
        agg.join(cid, now=0.0)
    assert agg.submit(upd("a", 1.0), now=0.0) is None
    assert agg.submit(upd("a", 2.0, seq=2, batch=6), now=0.1) is None  # replaces: 8 bytes held
    assert agg.submit(upd("b", 1.0), now=0.2) is None  # 16 bytes
    closed = agg.submit(upd("c", 1.0), now=0.3)  # 24 bytes: full
    assert closed is not None and closed.participants == ("a", "b", "c")
    assert agg.counters["closed_full"] == 1 and agg.counters["replaced"] == 1
    assert agg._round.nbytes == 0


@pytest.mark.parametrize("robust_off", [True, False])
def test_a_full_round_below_min_clients_folds_what_it_holds(robust_off):
    """`min_clients` 5 with room for 2 updates of 8 bytes: the round folds every second
    update into the strategy and holds at most 16 bytes; with the robust rules off its global
    is the one-shot round's (float rounding), with them on every client still takes part."""
    rules = {"clip_factor": 0.0, "max_share": 1.0} if robust_off else {}
    kw = dict(round_timeout=100.0, min_clients=5, clients=5, **rules)
    agg = make("async", round_max_mib=16 / 2**20, **kw)
    whole = make("async", round_max_mib=0.0, **kw)
    closed = None
    for i, cid in enumerate("abcde"):
        u = upd(cid, float(i), n=10 + i)
        assert agg._round.nbytes <= 16
        closed = agg.submit(u, now=0.1)
        whole_closed = whole.submit(u, now=0.1)
    assert closed is not None and closed.participants == tuple("abcde")
    assert agg.counters["spilled"] == 4 and agg.counters["round_size_5"] == 1
    if robust_off:
        np.testing.assert_allclose(closed.global_.tensors["w"],
                                   whole_closed.global_.tensors["w"], rtol=1e-6)


def test_a_newer_update_of_a_folded_client_waits_for_the_next_round():
    agg = make("async", round_timeout=100.0, min_clients=3, clients=4, round_max_mib=16 / 2**20,
               clip_factor=0.0, max_share=1.0)
    agg.submit(upd("a", 1.0), now=0.0)
    agg.submit(upd("b", 1.0), now=0.0)  # full: a and b folded
    assert agg._round.spilled == {"a": 1, "b": 1} and agg._round.nbytes == 0
    agg.submit(upd("a", 2.0, seq=2, batch=6), now=0.1)  # held for the next round
    closed = agg.submit(upd("c", 1.0), now=0.2)
    assert closed.seqs == {"a": 1, "b": 1, "c": 1}
    assert agg._round.updates["a"].seq == 2 and agg._round.nbytes == 8
    agg.submit(upd("b", 3.0, seq=2, batch=6), now=0.3)  # full again: a and b folded
    agg.submit(upd("a", 4.0, seq=3, batch=8), now=0.3)  # held
    agg.submit(upd("b", 5.0, seq=3, batch=8), now=0.3)  # held: full of what waits
    agg.submit(upd("a", 6.0, seq=4, batch=10), now=0.3)  # full: dropped, its seq 3 waits
    assert agg.counters["dropped_round_full"] == 1 and agg._round.nbytes == 16
    closed = agg.submit(upd("d", 1.0), now=0.4)
    assert closed.seqs == {"a": 2, "b": 2, "d": 1}
    assert {c: u.seq for c, u in agg._round.updates.items()} == {"a": 3, "b": 3}


def test_no_buffer_bound_waits_for_the_quorum():
    agg = make("async", round_timeout=100.0, min_clients=2, quorum=0.5, clients=6,
               round_max_mib=0.0)
    for cid in "abcdef":
        agg.join(cid, now=0.0)
    for cid in "abcde":
        assert agg.submit(upd(cid, 1.0), now=0.1) is None
    assert agg.counters["closed_full"] == 0



def test_a_lost_update_counts_as_reported():
    """4 active clients, c's update shed unread: the round of a, b and d closes without
    waiting for the timeout; an id off the active set and a lock-step tick are unchanged."""
    agg = make("async", round_timeout=100.0, min_clients=2, quorum=0.5, clients=4)
    for cid in "abcd":
        agg.join(cid, now=0.0)
    agg.submit(upd("a", 1.0), now=0.1)
    agg.submit(upd("b", 1.0), now=0.2)
    assert agg.lost({"c", "ghost"}, now=0.3) is None  # d has not reported
    closed = agg.submit(upd("d", 1.0), now=0.4)
    assert closed is not None and closed.participants == ("a", "b", "d")
    sync = make("sync")
    sync.submit(upd("a", 1.0))
    assert sync.lost({"b", "c"}) is None and sync._round.reported == {"a"}


@pytest.mark.parametrize(("told", "buffer", "least", "most"),
                         [(True, -1, 0.9, 1.0), (False, -1, 0.0, 0.33), (False, 0, 0.9, 1.0)])
def test_an_overloaded_async_round_folds_what_comes_in(told, buffer, least, most):
    """200 clients at random phases sending every 0.5 s for 20 s (virtual), a third of the
    sends shed unread (a full inbox), small updates that never fill `round_max_mib`: told of
    the lost updates, the rounds fold nearly every update that arrives; not told, a round
    waits until the last active client got one through while the others' newer updates
    replace theirs, and folds under a third (the collapse of sparse rounds under overload),
    unless it closes on half of the fleet's updates (`buffer` 0 from 100 devices on)."""
    agg = make("async", round_timeout=5.0, min_clients=2, quorum=0.5, clients=200, burn_in=0,
               jump=1, buffer=buffer)
    rng = np.random.default_rng(0)
    clients = [f"c{i:03d}" for i in range(200)]
    sends = sorted((t, c) for c, phase in zip(clients, rng.uniform(0, 0.5, 200), strict=True)
                   for t in np.arange(phase, 20.0, 0.5))
    seq: dict[str, int] = {}
    folded = 0
    for (t, c), shed in zip(sends, rng.uniform(size=len(sends)) < 1 / 3, strict=True):
        seq[c] = seq.get(c, 0) + 1
        if shed:
            closed = agg.lost({c}, float(t)) if told else None
        else:
            closed = agg.submit(upd(c, 1.0, seq=seq[c], batch=seq[c],
                                    base=agg.global_.version), now=float(t))
        closed = closed or agg.poll(float(t))
        folded += len(closed.participants) if closed and closed.global_ else 0
    share = folded / agg.counters["accepted"]
    assert least < share <= most, share
