"""The async simulator: same seed and profile, same global; profiles and traces checked with
one-line errors; a link keeps its order; the counters an MQTT run reports too; devices' steps
stacked ahead of their times make the same run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.learn.batched import FleetTrainer
from edgefcl.sim.clock import VirtualClock
from edgefcl.sim.profiles import DeviceClock, DeviceTiming, ProfileError, timings, write_trace
from edgefcl.sim.runs import simulate


def small(profile: str, seed: int = 0, batch_clients: str = "off", **fed) -> RunConfig:
    cfg = apply(RunConfig(), {"data": {"tasks": 2}, "fed": {"mode": "async", **fed},
                              "learn": {"local_epochs": 1, "batch_clients": batch_clients},
                              "quiet": True})
    return dataclasses.replace(cfg, profile=profile, seed=seed)


@pytest.mark.parametrize("profile", ["homogeneous", "heterogeneous"])
def test_same_seed_and_profile_give_the_same_global(profile):
    a, b = simulate(small(profile)), simulate(small(profile))
    assert a.global_sha256 == b.global_sha256
    assert a.extra["asynchrony"] == b.extra["asynchrony"]
    assert a.rounds > 0 and a.extra["asynchrony"]["folded"] >= 2 * a.rounds


@pytest.mark.parametrize("profile", ["heterogeneous", "congested"])
def test_devices_stepped_ahead_of_their_times_make_the_same_run(profile, monkeypatch):
    """With `--batch-clients on` a device steps when another's mini-batch is due, ahead of its
    own virtual time: with stacking turned off (every client alone) that is the run without
    batching bit for bit; with it on, the same schedule within float order."""
    off = simulate(small(profile))
    on = simulate(small(profile, batch_clients="on"))
    assert on.extra["stacked_steps"] > 0.3 * on.extra["batches"]
    assert on.extra["batches"] == off.extra["batches"]
    assert abs(on.acc.mean() - off.acc.mean()) < 0.05, (on.acc, off.acc)
    monkeypatch.setattr(FleetTrainer, "_layout", lambda self, client: None)
    alone = simulate(small(profile, batch_clients="on"))
    assert alone.extra["stacked_steps"] == 0
    assert alone.global_sha256 == off.global_sha256
    assert alone.extra["asynchrony"] == off.extra["asynchrony"]
    assert np.array_equal(alone.acc, off.acc)


def test_the_profile_changes_the_run():
    assert simulate(small("homogeneous")).global_sha256 != \
        simulate(small("heterogeneous")).global_sha256


def test_a_trace_reproduces_its_profile(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(path, timings("heterogeneous", 3, 0))
    assert timings(f"trace:{path}", 3, 0) == timings("heterogeneous", 3, 0)
    a = simulate(small(f"trace:{path}"))
    assert a.global_sha256 == simulate(small("heterogeneous")).global_sha256


def test_a_trace_repeats_its_last_device(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": [{"compute_s": 0.5}]}))
    assert [t.compute_s for t in timings(f"trace:{path}", 3, 0)] == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("text,message", [
    ("{", "not a JSON timing trace"),
    ("[]", "one object per device"),
    ('{"devices": [{"compute": 1}]}', "unknown fields ['compute']"),
    ('{"devices": [{"compute_s": -1}]}', "compute_s must be > 0"),
    ('{"devices": [{"dropout": 1.5}]}', "dropout must be in [0, 1)"),
    ('{"devices": [{"delay_s": "fast"}]}', "delay_s must be a finite number"),
    ('{"devices": [{"delay_s": NaN}]}', "delay_s must be a finite number"),
])
def test_bad_traces_get_one_line_errors(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as e:
        timings(f"trace:{path}", 2, 0)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_profiles_and_missing_traces_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="choose from homogeneous"):
        timings("fast", 2, 0)
    with pytest.raises(ProfileError, match="not found"):
        timings(f"trace:{tmp_path / 'none.json'}", 2, 0)


def test_a_link_keeps_its_order():
    """Lognormal delays would let a later message overtake: MQTT over TCP does not."""
    c = DeviceClock(DeviceTiming(delay_s=0.05, delay_sigma=2.0), seed=0, index=0)
    arrivals = [c.arrival(0.001 * i, "up") for i in range(200)]
    assert arrivals == sorted(arrivals)


def test_the_clock_runs_events_in_time_then_scheduling_order():
    clock, seen = VirtualClock(), []
    clock.at(2.0, seen.append, "c")
    clock.at(1.0, seen.append, "a")
    clock.at(1.0, seen.append, "b")
    clock.at(0.5, lambda: clock.after(0.25, seen.append, "first"))
    clock.run()
    assert seen == ["first", "a", "b", "c"] and clock.now == 2.0


def test_slowdowns_span_the_spread_and_follow_the_seed():
    from edgefcl.sim.profiles import slowdowns

    s = slowdowns(20, 0, 10.0)
    assert s.min() == 1.0 and s.max() == 10.0 and ((s >= 1) & (s <= 10)).all()
    assert (s == slowdowns(20, 0, 10.0)).all() and (s != slowdowns(20, 1, 10.0)).any()
    assert (slowdowns(5, 0, 1.0) == 1.0).all()
    assert [t.compute_s for t in timings("heterogeneous", 20, 0)] == list(0.03 * s)


def test_the_matched_trace_of_an_mqtt_run_by_hand():
    """100 mini-batches in 10 s: 0.1 s each; a std of 0.01 s is a uniform jitter of
    0.01 * sqrt(3) / 0.1 = 0.173; the second device started 2.5 s after the first; globals
    arrived 0.1-0.3 s after their rounds closed."""
    from edgefcl.sim.profiles import matched_trace

    closed = {"1": 1001.0, "2": 1002.0, "3": 1003.0}  # rounds closed (aggregator's clock)
    trace = matched_trace([
        {"batches": 100, "stream_s": 10.0, "batch_s_std": 0.01, "first_batch_at": 1000.0,
         "global_arrivals": {"1": 1001.1, "2": 1002.3, "3": 1003.2}},
        {"batches": 50, "stream_s": 10.0, "batch_s_std": 1.0, "first_batch_at": 1002.5}],
        closed)
    a, b = trace["devices"]
    assert (a["compute_s"], a["compute_jitter"], a["start_s"]) == (0.1, 0.1732, 0.0)
    assert a["delay_s"] == 0.2  # the median of 0.1, 0.3 and 0.2 s from close to arrival
    assert (b["compute_s"], b["compute_jitter"], b["start_s"]) == (0.2, 0.95, 2.5)
    assert b["delay_s"] == 0.005  # no arrivals: loopback
