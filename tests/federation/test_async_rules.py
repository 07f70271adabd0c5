"""Staleness, fold and device-merge rules (hand-computed values), FedBuff rounds, the async
counters, and their composition with sharding."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import STALENESS_KEYS, Aggregator, async_stats
from edgefcl.federation.folds import FOLDS
from edgefcl.federation.messages import Update
from edgefcl.federation.robust import prepare_round
from edgefcl.federation.round_weights import newest_task, weigh
from edgefcl.federation.shard import ShardRoot, ShardWorker
from edgefcl.federation.staleness import staleness_rule
from edgefcl.federation.strategy import FedAvg
from edgefcl.learn.merges import MERGES

RULES_OFF = dict(clip_factor=0.0, max_share=1.0, sigma_floor=0.0)


def upd(cid: str, value: float, base: int = 0, seq: int = 1, n: int = 10) -> Update:
    return Update(cid, base, seq, 0, seq, n, {"w": np.full(2, value, np.float32)}, "dense",
                  {0: n})


def test_staleness_rules_by_hand():
    assert staleness_rule("constant", 0.5, 4)(7) == 1.0
    assert staleness_rule("polynomial", 0.5, 0)(3) == pytest.approx(0.5)  # (1+3)^-0.5
    hinge = staleness_rule("hinge", 10.0, 1.0)
    assert hinge(1) == 1.0 and hinge(3) == pytest.approx(1 / 21)  # 1 / (10 (3-1) + 1)


def test_staleness_weights_the_update_and_the_round_mix():
    """Two updates of 10 samples, staleness 0 and 3 under (1+tau)^-0.5: weights 1 and 0.5, so
    the estimate is (4 + 0.5 * 1) / 1.5 = 3, and the mix is 0.5 * 15/20 = 0.375:
    0.375 * 3 + 0.625 * 0 = 1.125."""
    fed = FedConfig(staleness="polynomial", staleness_a=0.5, **RULES_OFF)
    s = FedAvg(fed, {"w": (2,)})
    for u in weigh([upd("a", 4.0, base=3), upd("b", 1.0, base=0)], 3, fed, s):
        s.add(u)
    assert s.mix_weight == pytest.approx(0.375)
    np.testing.assert_allclose(s.result({"w": np.zeros(2, np.float32)})["w"], 1.125)


def test_task_lag_weighs_updates_behind_the_newest_task():
    """task_decay 0.5: an update one task behind weighs half, two behind a quarter; the
    round's mix is not changed by it (it is relative)."""
    fed = FedConfig(mode="async", task_decay=0.5, **RULES_OFF)
    s = FedAvg(fed, {"w": (2,)})
    ups = [replace(upd(c, 1.0), task=t) for c, t in (("a", 2), ("b", 1), ("c", 0))]
    assert [u.num_samples for u in weigh(ups, 0, fed, s)] == [10, 5, 2.5]
    assert s.mix_weight == 0.5
    sync = FedConfig(mode="sync", task_decay=0.5, **RULES_OFF)  # lock-step: the paper's rule
    assert weigh(ups, 0, sync, FedAvg(sync, {"w": (2,)})) is ups


def test_a_claimed_task_far_ahead_does_not_decay_the_others_away():
    # a reviewer helper's attack: the newest task was the largest claim, so one update of
    # task 10^9 weighed every other 0.5^(10^9) (with --max-share 1, the whole round); the
    # newest is now at most one past the lower median claim, and none weighs more for being
    # ahead of it
    fed = FedConfig(mode="async", task_decay=0.5, **RULES_OFF)
    ups = [replace(upd(c, 1.0), task=0) for c in "abc"] + [replace(upd("x", 1.0), task=10**9)]
    assert [u.num_samples for u in weigh(ups, 0, fed, FedAvg(fed, {"w": (2,)}))] == [
        5, 5, 5, 10]
    assert newest_task([0, 0, 10**9]) == 1 and newest_task([0, 10**9]) == 1
    assert newest_task([2, 1, 0]) == 2 and newest_task([3, 3, 1, 1]) == 2


def test_a_fresh_device_among_stale_ones_keeps_to_the_share_cap():
    """Attack: one device on the current global while the honest ones are stale (or behind
    its claimed task) would hold most of the round's weight after the staleness and task
    weights; those weights come before the share cap, so it holds at most max_share."""
    fed = FedConfig(mode="async", staleness="hinge", staleness_a=10.0, staleness_b=0.0,
                    task_decay=0.1,
                    max_share=0.0, clip_factor=0.0, sigma_floor=0.0)
    honest = [replace(upd(f"h{i}", 1.0, base=0), task=0) for i in range(3)]
    attacker = replace(upd("x", 9.0, base=3, n=50), task=99)
    s = FedAvg(fed, {"w": (2,)})
    for u in prepare_round(weigh(honest + [attacker], 3, fed, s),
                           {"w": np.zeros(2, np.float32)}, fed, Counter()):
        s.add(u)
    new, _ = s.estimate({"w": np.zeros(2, np.float32)})
    share = (new["w"][0] - 1.0) / (9.0 - 1.0)  # the attacker's part of the average
    assert share <= 0.5 + 1e-9  # 2 / 4 devices, at most a half


def test_the_constant_rule_leaves_the_mix_alone():
    s = FedAvg(FedConfig(**RULES_OFF), {"w": (2,)})
    s.add(upd("a", 1.0, base=0))
    assert s.mix_weight == 0.5


def test_delta_fold_applies_each_change_to_the_current_global():
    """current 1.0, the update's base 0.5 and value 0.7: 1.0 + (0.7 - 0.5) = 1.2; a BatchNorm
    statistic keeps the value sent."""
    u = Update("a", 0, 1, 0, 1, 5, {"w": np.full(2, 0.7, np.float32),
                                    "bn.running_var": np.full(2, 2.0, np.float32)}, "dense")
    bases = {0: {"w": np.full(2, 0.5, np.float32), "bn.running_var": np.ones(2, np.float32)}}
    current = {"w": np.ones(2, np.float32), "bn.running_var": np.ones(2, np.float32)}
    c: Counter = Counter()
    (out,) = FOLDS["delta"].apply([u], current, 2, bases.get, c)
    np.testing.assert_allclose(out.tensors["w"], 1.2, rtol=1e-6)
    np.testing.assert_allclose(out.tensors["bn.running_var"], 2.0)
    assert c["rebased"] == 1
    assert FOLDS["delta"].apply([u], current, 2, lambda v: None, c) == []
    assert c["rejected_base_gone"] == 1


def test_device_merge_rules_by_hand():
    merged, now, sent = {"w": np.array([1.0]), "s": np.array([5.0])}, \
        {"w": np.array([3.0]), "s": np.array([7.0])}, {"w": np.array([2.0]), "s": np.array([6.0])}
    assert MERGES["replace"].apply(merged, now, sent, {"w"}, 1.0) is merged
    out = MERGES["delta"].apply(merged, now, sent, {"w"}, 1.0)
    assert out["w"][0] == 2.0 and out["s"][0] == 5.0  # 1 + (3 - 2); statistics: the global's
    assert MERGES["staleness"].apply(merged, now, sent, {"w"}, 0.5)["w"][0] == 1.5


def test_buffered_rounds_close_every_k_updates():
    """FedBuff: with K = 3 the round closes on the third update that came in (a client's
    newer update replacing its older counts), without waiting for the silent third client."""
    fed = FedConfig(mode="async", clients=3, min_clients=2, buffer=3, burn_in=0, jump=1,
                    round_timeout=1e9, **RULES_OFF)
    agg = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in ("a", "b", "c"):
        agg.join(c, 0.0)
    assert agg.submit(upd("a", 1.0, seq=1), 0.0) is None
    assert agg.submit(upd("a", 2.0, seq=2), 0.0) is None
    closed = agg.submit(upd("b", 4.0, seq=1), 0.0)
    assert closed is not None and closed.participants == ("a", "b")
    assert agg.counters["closed_buffer"] == 1


def test_async_counters_summarise_rounds_and_staleness():
    fed = FedConfig(mode="async", clients=2, min_clients=2, burn_in=0, jump=1,
                    round_timeout=1e9, **RULES_OFF)
    agg = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in ("a", "b"):
        agg.join(c, 0.0)
    agg.submit(upd("a", 1.0, seq=1), 0.0)
    agg.submit(upd("b", 1.0, seq=1), 0.0)  # round 1: both on version 0
    agg.submit(upd("a", 1.0, base=1, seq=2), 0.0)
    agg.submit(upd("b", 1.0, base=0, seq=2), 0.0)  # round 2: staleness 0 and 1
    stats = async_stats(agg.counters)
    assert stats["rounds"] == 2 and stats["folded"] == 4
    assert stats["staleness"] == {0: 3, 1: 1} and stats["staleness_mean"] == 0.25
    assert stats["round_sizes"] == {2: 2} and stats["updates_per_round"] == 2.0


def test_claimed_bases_cannot_grow_the_counters_a_key_a_round():
    # a reviewer helper's attack: lock-step checks no staleness, and each new base a device
    # claimed made a new counter key; after 2,100 rounds the status that carries them was past
    # what the supervisor, the replayer and the shard workers decode
    fed = FedConfig(mode="sync", clients=2, min_clients=2, burn_in=0, jump=1, **RULES_OFF)
    agg = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in ("h", "x"):
        agg.join(c, 0.0)
    for seq in range(1, 301):
        v = agg.global_.version
        agg.submit(upd("h", 0.1, base=v, seq=seq))
        assert agg.submit(upd("x", 0.1, base=seq % (v + 1), seq=seq)) is not None
    stats = async_stats(agg.counters)
    assert len(stats["staleness"]) <= STALENESS_KEYS + 1 and stats["folded"] == 600
    assert max(stats["staleness"]) == STALENESS_KEYS  # "that many versions or more"
    # ... and the mean is not capped: x's base 0 at version seq - 1, h's current (0 behind)
    assert stats["staleness_mean"] == sum(range(300)) / 600 == 74.75
    # counters resumed from a state saved before the sum (one update summed of two): the
    # histogram's mean (0 + 5) / 2, not the sum over every update (3 / 2)
    resumed = {"folded_staleness_0": 1, "folded_staleness_5": 1, "folded_staleness_sum": 3,
               "folded_staleness_summed": 1}
    assert async_stats(resumed)["staleness_mean"] == 2.5


@pytest.mark.parametrize("fold,staleness", [("model", "polynomial"), ("delta", "hinge"),
                                            ("delta", "constant")])
def test_staleness_and_fold_rules_shard_exactly(fold, staleness):
    """Stale updates (bases 0-2 behind) through two workers and the root give the single
    aggregator's global, round after round."""
    rng = np.random.default_rng(3)
    fed = FedConfig(mode="async", clients=4, min_clients=4, burn_in=0, jump=1,
                    round_timeout=1e9, fold=fold, staleness=staleness, staleness_a=1.0,
                    staleness_b=0.0, **RULES_OFF)
    initial = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
    single = Aggregator(initial, fed, batch_size=32)
    ws = [ShardWorker(initial, fed, batch_size=32, worker=f"w{j}") for j in range(2)]
    root = ShardRoot(initial, fed, batch_size=32)
    for w in ws:
        root.worker_online(w.worker)
    for r in range(4):
        ups = [Update(f"c{i}", max(r - i % 3, 0), r + 1, 0, r + 1, int(rng.integers(2, 9)),
                      {"w": rng.normal(size=(3, 2)).astype(np.float32)}, "dense")
               for i in range(4)]
        a = [single.submit(u, 0.0) for u in ups][-1]
        for i, u in enumerate(ups):
            ws[i % 2].submit(u, 0.0)
        b = None
        for w in ws:
            assert root.merge(w.flush(), 0.0) is None
            b = root.poll(0.0) or b
        np.testing.assert_allclose(b.global_.tensors["w"], a.global_.tensors["w"], rtol=1e-5,
                                   atol=1e-6, err_msg=f"round {r}")
        for w in ws:
            w.set_global(b.global_)
