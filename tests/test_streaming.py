"""Async rounds fold each update on arrival: memory independent of the client count, and the
online robust rules (`federation/robust/online.py`) by hand."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.federation.robust.online import StreamRules, share_factor, typical_sigma

ZERO = {"w": np.zeros(2, np.float32)}


def upd(client, value, n=8, seq=1):
    return Update(client, 0, seq, 0, seq, n, {"w": np.full(2, value, np.float32)})


def async_round(updates, initial=None, **fed):
    f = FedConfig(**{"clients": len(updates), "burn_in": 0, "jump": 1, "mode": "async",
                     "min_clients": 1, "mix": 1.0, "round_timeout": 1e9, **fed})
    agg = Aggregator(dict(initial or ZERO), f)
    for u in updates:
        agg.join(u.client)
    closed = None
    for u in updates:
        closed = agg.submit(u, now=0.0) or closed
    assert closed is not None and closed.global_ is not None, dict(agg.counters)
    return closed.global_.tensors, agg.counters


def peak_bytes(n_clients: int, aggregation: str = "fedavg", size: int = 50_000) -> int:
    """tracemalloc peak of one async round of `n_clients` updates of `size` float32 entries,
    each made just before it is submitted (so the test itself holds none)."""
    f = FedConfig(clients=n_clients, roster_cap=n_clients, burn_in=0, jump=1, mode="async",
                  min_clients=n_clients, round_timeout=1e9, aggregation=aggregation)
    agg = Aggregator({"w": np.zeros(size, np.float32)}, f)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    closed = None
    for i in range(n_clients):
        u = Update(f"c{i}", 0, 1, 0, 1, 8,
                   {"w": rng.normal(0, 1, size).astype(np.float32)})
        closed = agg.submit(u, now=0.0) or closed
        del u
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert closed is not None and closed.global_ is not None
    return peak


def test_async_memory_does_not_grow_with_the_clients() -> None:
    small, large = peak_bytes(10), peak_bytes(200)
    assert large < 1.3 * small, (small, large)
    # the buffering rules keep every update: the same measure sees them grow
    assert peak_bytes(200, "median") > 5 * peak_bytes(10, "median")


def test_online_clipping_by_hand() -> None:
    # norms sqrt(2), sqrt(2), 100 sqrt(2): median of the window sqrt(2), tau 3 sqrt(2) -> c at 3
    g, counters = async_round([upd("a", 1.0), upd("b", 1.0), upd("c", 100.0)], max_share=1.0)
    np.testing.assert_allclose(g["w"], [(1 + 1 + 3) / 3] * 2, rtol=1e-6)
    assert counters["clipped"] == 1
    g, _ = async_round([upd("a", 1.0), upd("b", 1.0), upd("c", 100.0)],
                       clip_norm=np.sqrt(2) / 2, max_share=1.0)
    np.testing.assert_allclose(g["w"], [0.5, 0.5], rtol=1e-6)


def test_the_clipping_window_is_bounded() -> None:
    fed = FedConfig(clip_factor=1.5, max_share=1.0)
    rules, c = StreamRules(fed, window=2), Counter()
    for v in (100.0, 100.0, 1.0):  # window (100, 1) sqrt(2): tau 75.75 sqrt(2), no clip
        rules.apply(upd("a", v), ZERO, c)
    assert list(rules.norms) == pytest.approx([100 * np.sqrt(2), np.sqrt(2)])
    out = rules.apply(upd("b", 1000.0), ZERO, c)  # window (1, 1000): tau 1.5 x 500.5 sqrt(2)
    np.testing.assert_allclose(out.tensors["w"], [750.75, 750.75], rtol=1e-6)
    assert c["clipped"] == 1


def test_online_share_cap_by_hand() -> None:
    # weights 8, 8, 8, 10**6: median 8, cap 2 x 8 = 16 -> z counts 16 of 40
    g, counters = async_round([upd("a", 0.0), upd("b", 0.0), upd("c", 0.0),
                               upd("z", 1.0, n=10**6)], clip_factor=0.0)
    np.testing.assert_allclose(g["w"], [16 / 40] * 2, rtol=1e-6)
    assert counters["share_capped"] == 1
    assert share_factor(FedConfig(max_share=0.0)) == 2.0
    assert share_factor(FedConfig(max_share=0.5, min_clients=6)) == 3.0
    assert share_factor(FedConfig(max_share=0.1, min_clients=2)) == 1.0


def test_online_share_cap_scales_class_counts() -> None:
    rules, c = StreamRules(FedConfig(clip_factor=0.0)), Counter()
    rules.apply(upd("a", 0.0, n=10), ZERO, c)
    u = Update("z", 0, 1, 0, 1, 100, {"w": np.zeros(2, np.float32)},
               class_counts={0: 50, 1: 50})
    out = rules.apply(u, ZERO, c)  # median(10, 100) = 55, bound 110: not capped
    assert out.num_samples == 100
    out = rules.apply(Update("y", 0, 1, 0, 1, 1000, u.tensors, class_counts={0: 1000}), ZERO, c)
    assert out.num_samples == 200 and out.class_counts == {0: 200}  # median 100 -> bound 200


def test_online_rules_off_leave_fedavg_unchanged() -> None:
    ups = [upd("a", 1.0, n=3), upd("b", 5.0, n=1), upd("c", 2.0, n=100)]
    g, counters = async_round(ups, clip_factor=0.0, max_share=1.0)
    np.testing.assert_allclose(g["w"], [(3 + 5 + 200) / 104] * 2, rtol=1e-6)
    assert not counters["clipped"] and not counters["share_capped"]


@pytest.mark.parametrize("rule", ["conflation", "fedbnn"])
def test_online_sigma_floor_by_hand(rule) -> None:
    base = {"w::mu": np.zeros(2, np.float32), "w::sigma": np.ones(2, np.float32)}

    def g(client, mu, sigma):
        return Update(client, 0, 1, 0, 1, 8, {"w::mu": np.full(2, mu, np.float32),
                                              "w::sigma": np.full(2, sigma, np.float32)},
                      encoding="gaussian")

    ups = [g("a", 0.0, 0.5), g("b", 0.0, 0.5), g("c", 0.0, 0.5), g("x", 10.0, 1e-6)]
    # typical sigmas 0.5, 0.5, 0.5, 1e-6: median 0.5, floor 0.25 on both entries of x
    out, counters = async_round(ups, initial=base, encoding="gaussian", aggregation=rule)
    assert counters["sigma_floored"] == 2
    assert out["w::mu"][0] < 6.0
    unprotected, _ = async_round(ups, initial=base, encoding="gaussian", aggregation=rule,
                                 sigma_floor=0.0)
    assert unprotected["w::mu"][0] > 9.99


def test_typical_sigma_ignores_uninformative_entries() -> None:
    assert typical_sigma(np.array([0.5, 1024.0, 0.7, 2000.0])) == pytest.approx(0.6)
    assert np.isnan(typical_sigma(np.array([1024.0])))


def test_async_counts_the_first_update_of_a_client_per_round() -> None:
    g, counters = async_round([upd("a", 1.0), upd("a", 9.0, seq=2), upd("b", 3.0)],
                              clip_factor=0.0)
    np.testing.assert_allclose(g["w"], [2.0, 2.0])
    assert counters["rejected_round-repeat"] == 1 and counters["accepted"] == 2
