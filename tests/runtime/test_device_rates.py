"""A device's update rate from the times of its last updates (runtime/device_rates.py), with
hand-computed values."""

from __future__ import annotations

import pytest

from edgefcl.runtime.device_rates import HORIZON_S, MAX_UPDATES, DeviceRates


def test_a_device_due_every_7_s_reads_its_rate_at_each_update() -> None:
    # a rate smoothed over 2 s intervals read 0.05/s at each update of a device sending 0.14/s
    rates = DeviceRates()
    for k in range(6):
        rates.note("d", 7.0 * k)
        assert rates.rate("d", 7.0 * k, span=2.0) == pytest.approx(
            1 / 7 if k else 1 / 2)  # seen once: one update over the interval
    assert rates.rate("d", 35.0 + 3.5, span=2.0) == pytest.approx(1 / 7)
    assert rates.rate("d", 35.0 + 14.0, span=2.0) == pytest.approx(1 / 14)  # gone quiet


def test_the_rate_spans_the_last_six_seconds_and_at_least_four_updates() -> None:
    rates = DeviceRates()
    for k in range(20):  # 2/s for 10 s
        rates.note("d", 0.5 * k)
    # the last 6 s hold 13 updates (12 gaps of 0.5 s); 16 are kept
    assert rates.rate("d", 9.5, span=2.0) == pytest.approx(2.0)
    assert len(rates.times["d"]) == MAX_UPDATES
    rates.note("d", 9.5 + 30.0)  # a burst 30 s later: the gap is in the last 4 updates...
    assert rates.rate("d", 39.5, span=2.0) == pytest.approx(3 / (30.0 + 1.0))
    for k in range(1, 4):  # ...and forgotten 3 updates into it
        rates.note("d", 39.5 + 0.5 * k)
    assert rates.rate("d", 41.0, span=2.0) == pytest.approx(2.0)
    assert HORIZON_S == 6.0


def test_updates_refused_in_an_interval_are_spread_over_it() -> None:
    rates = DeviceRates()
    rates.note("d", 10.5)  # one got through mid-interval, 9 more were refused in (10, 11]
    rates.note("d", 11.0, n=9, since=10.0)
    times = list(rates.times["d"])
    assert times == sorted(times) and len(times) == 10
    # 10 updates in (10, 11], all within the horizon: 9 gaps over 11 - (10 + 1/9) s
    assert rates.rate("d", 11.0, span=1.0) == pytest.approx(81 / 8)
    rates.note("e", 11.0, n=1000, since=10.0)  # a flood: only the last 16 are kept
    assert len(rates.times["e"]) == MAX_UPDATES
    assert rates.rate("e", 11.0, span=1.0) == pytest.approx(1000.0)


def test_forgotten_devices_leave_the_table() -> None:
    rates = DeviceRates()
    for d in "abc":
        rates.note(d, 1.0)
    rates.keep({"a"})
    assert set(rates.times) == {"a"} and rates.rate("b", 2.0, span=2.0) == 0.0
    assert rates.last("a") == 1.0 and rates.last("b") is None


def test_the_last_gap_and_the_mean_period() -> None:
    rates = DeviceRates()
    assert rates.gap("d") is None and not rates.within_periods("d", 0.0, 2.0)  # never seen
    rates.note("d", 0.0)
    assert rates.gap("d") is None and not rates.within_periods("d", 0.0, 2.0)  # seen once
    for at in (9.0, 10.0, 24.0):
        rates.note("d", at)
    assert rates.gap("d") == pytest.approx(14.0)  # 24 - 10
    # mean period over every kept update: 24 / 3 = 8 s; two of them: 16 s after the last
    assert rates.within_periods("d", 24.0 + 15.9, 2.0)
    assert not rates.within_periods("d", 24.0 + 16.1, 2.0)
