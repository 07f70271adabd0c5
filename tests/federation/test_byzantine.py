"""firmware_sim's Byzantine devices against the aggregator's message path (no broker): each
attack is rejected or bounded, the daemon never stops, the global stays near the honest one."""

from __future__ import annotations

import numpy as np
import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.links import NullLink
from edgefcl.transport.chunks import is_chunk
from edgefcl.transport.codec import encode
from firmware_sim.byzantine import ATTACKS, Byzantine

INITIAL = {"fc.weight": np.zeros((4, 4), np.float32), "fc.bias": np.zeros(4, np.float32),
           "norm.running_var": np.ones(4, np.float32)}
HONEST = [f"h{i}" for i in range(6)]
TARGET = 0.5
EXPECTED = {  # the counter that shows the defence at work
    "inflate": "rejected_samples", "scaled": "clipped", "sign-flip": "clipped",
    "noise": "accepted", "bn-var": "rejected_variance", "bomb": "rejected_limits",
    "stop": "rejected_kind", "replay": "rejected_replay", "ghost": "rejected_roster",
    "chunk-flood": None,  # to the link's reassembler (tests/transport/test_boundary_codec.py)
}


def run_fleet(attack: str, state_dir, **fed) -> tuple[float, dict]:
    """6 honest clients pulling the weights to TARGET and 2 attackers, 5 rounds; returns the
    largest deviation of the global from TARGET and the aggregator's counters."""
    cfg = apply(RunConfig(), {"quiet": True, "mqtt": {"fleet": "byz"},
                              "fed": {"clients": 6, "roster_cap": 8, "mode": "async",
                                      "min_clients": 2, "burn_in": 0, "jump": 1,
                                      "round_timeout": 1e6, **fed}})  # rounds close at poll
    d = AggregatorDaemon(cfg, INITIAL, state_dir)
    d.link = NullLink()
    byz = Byzantine(cfg, 2, attack, seed=1)
    rng = np.random.default_rng(0)
    bs = cfg.data.batch_size
    for step in range(1, 6):
        g = d.agg.global_
        byz.globals = [*byz.globals[-1:], GlobalModel(g.version, g.tensors)]
        for a in byz.attackers:
            for topic, payload, _ in byz._payloads(a, byz.globals):
                if not is_chunk(payload):
                    d.handle(topic, payload)
        for c in HONEST:
            t = {k: (np.ones(v.shape, np.float32) if k.endswith("running_var") else
                     np.full(v.shape, TARGET, np.float32) + rng.normal(0, 0.01, v.shape)
                     .astype(np.float32)) for k, v in INITIAL.items()}
            upd = Update(c, g.version, step, 0, step, bs * step, t, class_counts={0: bs * step})
            d.handle(d.topics.update(c), encode(upd, fleet="byz"))
        d._close_safely(lambda: d.agg.poll(1e9))
        assert not d.stop_event.is_set()
    assert d.agg.counters["rejected_internal"] == 0 and d.agg.rounds >= 5
    w = d.agg.global_.tensors["fc.weight"]
    assert (d.agg.global_.tensors["norm.running_var"] > 0).all()
    dev = float(np.abs(w - TARGET).max()) if np.isfinite(w).all() else float("inf")
    d.store.close()
    return dev, dict(d.agg.counters)


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_attack_is_rejected_or_bounded(attack, tmp_path) -> None:
    dev, counters = run_fleet(attack, tmp_path / "state")
    if EXPECTED[attack] is not None:
        assert counters.get(EXPECTED[attack], 0) > 0, counters
    assert dev < 0.5, (attack, dev, counters)


def test_without_the_robust_rules_the_scaled_attack_takes_the_global(tmp_path) -> None:
    off, _ = run_fleet("scaled", tmp_path / "off", clip_factor=0.0, max_share=1.0)
    on, _ = run_fleet("scaled", tmp_path / "on")
    assert off > 5.0 and on < 0.5
