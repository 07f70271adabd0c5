"""Sparse globals (`--global-topk`, federation/sparse_global.py): each version changes only the
largest entries of each large tensor, the rest of the change waits on the aggregator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgefcl.config import ConfigError, FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.federation.sparse_global import ALWAYS_WHOLE, sparse_step
from edgefcl.federation.versions import delta_downlink, global_delta

N = 2000  # a tensor above ALWAYS_WHOLE: ceil(0.001 x 2000) = 2 entries change per version


def step(held, target, fraction):
    """(the published global, what it holds back: target - published, per tensor held back)."""
    out = sparse_step(held, target, fraction)
    return out, {k: t - out[k] for k, t in target.items() if out[k] is not t}


def test_the_largest_changes_are_published_and_the_rest_kept():
    held = {"w": np.zeros(N, np.float32), "b": np.zeros(4, np.float32),
            "n": np.zeros((), np.int64)}
    result = {"w": np.zeros(N, np.float32), "b": np.array([1, 2, 3, 4], np.float32),
              "n": np.array(7, np.int64)}
    result["w"][[5, 9, 100]] = [3.0, -4.0, 1.0]
    out, residual = step(held, result, 0.001)
    expect = np.zeros(N, np.float32)
    expect[[5, 9]] = [3.0, -4.0]  # |-4| and |3| are the two largest changes
    np.testing.assert_array_equal(out["w"], expect)
    np.testing.assert_array_equal(residual["w"][100], 1.0)
    assert np.count_nonzero(residual["w"]) == 1
    np.testing.assert_array_equal(out["b"], result["b"])  # small: whole, no residual
    assert out["n"] == 7 and set(residual) == {"w"}


def test_the_residual_arrives_in_later_versions():
    held = {"w": np.zeros(N, np.float32)}
    target = np.zeros(N, np.float32)
    target[:7] = [7, 6, 5, 4, 3, 2, 1]
    out, residual = step(held, {"w": target}, 0.001)
    np.testing.assert_array_equal(out["w"][:7], [7, 6, 0, 0, 0, 0, 0])
    for _ in range(3):  # rounds that change nothing more: the residual drains, 2 at a time
        out, residual = step(out, {"w": out["w"] + residual["w"]}, 0.001)
    np.testing.assert_array_equal(out["w"], target)
    assert not residual["w"].any()


def test_a_fraction_that_covers_the_tensor_publishes_it_whole():
    held = {"w": np.zeros(N, np.float32)}
    out, residual = step(held, {"w": np.ones(N, np.float32)}, 0.9999)
    np.testing.assert_array_equal(out["w"], 1.0)
    assert "w" not in residual


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, ALWAYS_WHOLE + 40, elements=st.floats(-1e3, 1e3, width=32)),
       arrays(np.float32, ALWAYS_WHOLE + 40, elements=st.floats(-1e3, 1e3, width=32)),
       st.floats(0.001, 0.5))
def test_published_plus_residual_is_the_target_and_few_entries_move(old, new, fraction):
    out, residual = step({"w": old}, {"w": new}, fraction)
    k = math.ceil(fraction * old.size)
    assert np.count_nonzero(out["w"] != old) <= k
    np.testing.assert_allclose(out["w"] + residual.get("w", 0), new, rtol=1e-6, atol=1e-3)
    assert out["w"].dtype == np.float32


def _fed(**kw) -> FedConfig:
    return FedConfig(clients=3, min_clients=3, burn_in=0, jump=1, mix=1.0, clip_factor=0,
                     max_share=1, **kw)


def test_the_aggregator_publishes_sparse_globals_and_restores_what_it_holds_back():
    initial = {"w": np.zeros(N, np.float32), "b": np.zeros(3, np.float32)}
    agg = Aggregator(initial, _fed(global_topk=0.01))
    rng = np.random.default_rng(0)
    previous = agg.global_.tensors
    for version in range(1, 4):
        mark = agg.mark()
        sent = []
        for c in "abc":
            sent.append(rng.normal(size=N).astype(np.float32))
            closed = agg.submit(Update(c, version - 1, version, 0, version, 10,
                                       {"w": sent[-1], "b": np.ones(3, np.float32)}))
        assert closed is not None and closed.global_ is not None
        g = closed.global_.tensors
        # mix 1: the round's model is the updates' mean, whatever was published before
        np.testing.assert_allclose(agg.server_global()["w"], np.mean(sent, axis=0),
                                   rtol=1e-5, atol=1e-6)
        assert np.count_nonzero(g["w"] != previous["w"]) <= math.ceil(0.01 * N)
        np.testing.assert_array_equal(g["b"], 1.0)
        delta = global_delta(g, previous, version - 1)
        assert delta is not None and "w" not in delta  # the change travels as indices
        previous = g
    server = agg._server
    agg.restore(mark)
    assert agg._server is not server and agg.global_.version == 2


def test_config_needs_a_delta_downlink_and_an_encoding_that_has_one():
    cfg = apply(RunConfig(), {"fed": {"global_topk": 0.05}})
    assert delta_downlink(cfg.fed)
    with pytest.raises(ConfigError, match="global_topk needs --downlink sparse"):
        apply(RunConfig(), {"fed": {"global_topk": 0.05, "downlink": "dense"}})
    with pytest.raises(ConfigError, match="global_topk"):
        apply(RunConfig(), {"learn": {"method": "vfcl"}, "fed": {"global_topk": 0.05}})
    with pytest.raises(ConfigError, match=r"global_topk must be in \[0, 1\)"):
        apply(RunConfig(), {"fed": {"global_topk": 1.0}})
