"""Fair service under backpressure (runtime/update_quota.py): a device that ignores the factor
gets no more of its updates handled than a compliant one (at most 1.5x)."""

from __future__ import annotations

from collections import Counter

from edgefcl.runtime.update_quota import UpdateQuota


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(quota: UpdateQuota, factor: float, seconds: int = 60, warm: int = 10
          ) -> dict[str, int]:
    """20 devices: 19 send 2 updates/s / factor (compliant), 'x' sends 2/s (ignores it); what
    each got handled in `seconds` s after `warm` s (the quota measures a few intervals
    before it limits anyone: the first spans the daemon's start)."""
    admitted = dict.fromkeys([*(f"d{i}" for i in range(19)), "x"], 0)
    credit = {d: i / 19 for i, d in enumerate(admitted)}  # desynchronised, as Pacer does
    for t in range((warm + seconds) * 2):  # 0.5 s steps; a status interval every 2 s
        quota.clock.t = t / 2
        if t == warm * 2:
            admitted = dict.fromkeys(admitted, 0)
        for d in admitted:  # a due update every 0.5 s
            credit[d] += 1.0 if d == "x" else 1.0 / factor
            if credit[d] >= 1.0:
                credit[d] -= 1.0
                admitted[d] += quota.admit(d, d)
        if t % 4 == 3:
            quota.end_interval(2.0, set(admitted), factor)
        for d in quota.release():  # a waiting update, handled once its token came
            admitted[d] += 1
    return admitted


def test_an_ignoring_device_gets_at_most_1_5x_a_compliant_ones_share() -> None:
    # the attack: with 20 % of devices ignoring the factor, they got 106 updates folded in
    # 60 s against 10 for compliant ones
    quota = UpdateQuota(clock=Clock())
    got = run(quota, factor=2.0)  # compliant: 1/s (the limit never goes below one update a
    # device and status interval, 0.5/s: below that rate the bar is not kept)
    compliant = sorted(v for d, v in got.items() if d != "x")
    median = compliant[len(compliant) // 2]
    assert got["x"] <= 1.5 * median
    assert quota.shed["x"] > 0 and not any(quota.shed[d] for d in got if d != "x")
    assert set(quota.waiting) <= {"x"}  # at most its newest update waits


def test_no_limit_without_backpressure() -> None:
    quota = UpdateQuota(clock=Clock())
    got = run(quota, factor=1.0)
    assert got["x"] == 120 and not quota.shed and quota.limit is None


def test_nothing_is_limited_in_the_first_intervals() -> None:
    # after a restart the devices' sessions deliver their backlog at once: the first
    # intervals are not a device's rate
    quota = UpdateQuota(clock=Clock())
    quota.end_interval(2.0, {"a", "b"}, factor=8.0)
    quota.end_interval(2.0, {"a", "b"}, factor=8.0)
    assert quota.limit is None and all(quota.admit("a") for _ in range(50))


def test_the_updates_the_inbox_refused_count_in_a_devices_rate() -> None:
    # an ignoring device whose updates the full inbox refuses looked within its limit by what
    # got past the inbox, so every other interval it was let through unlimited
    quota = UpdateQuota(clock=Clock())
    for _ in range(4):
        for d in "abc":
            quota.admit(d)
        quota.end_interval(1.0, {"a", "b", "c"}, factor=2.0, inbox_refused=Counter(c=9))
    assert quota.rates["c"] > 9 and quota.rates["a"] < 1.5
    assert quota.limit is not None and "c" in quota.over() and "a" not in quota.over()
