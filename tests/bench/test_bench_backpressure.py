"""`edgefcl bench backpressure`: its table, JSON and plot."""

from __future__ import annotations

import json

import pytest

from edgefcl.bench import backpressure_loop
from edgefcl.bench.backpressure_loop import SPARSE_ROUNDS, Loop, bench_backpressure


@pytest.fixture
def two_cases(monkeypatch):
    monkeypatch.setattr(backpressure_loop, "CASES", [
        {"pacing": "random", "offered": 2.0}, {"pacing": "random", "offered": 2.0,
                                               **SPARSE_ROUNDS}])


def test_one_seed_has_no_spread_and_a_fleet_smaller_than_a_round_skips_it(two_cases, tmp_path,
                                                                           capsys):
    report = bench_backpressure(tmp_path, seeds=1, base=Loop(devices=100, capacity=100.0,
                                                             seconds=20.0))
    out = capsys.readouterr().out
    assert "±" not in out  # a sample std needs two seeds
    assert "random 2x, rounds of 1000: skipped (rounds of 1000 need 1000 devices or more)" in out
    assert [r["label"] for r in report["rows"]] == ["random 2x"]
    saved = json.loads((tmp_path / "bench_backpressure.json").read_text())
    assert saved["rows"][0]["folded_over_capacity"][1] is None
    assert (tmp_path / "bench_backpressure.png").stat().st_size > 10_000


def test_several_seeds_give_mean_and_sample_std(two_cases, tmp_path, capsys):
    report = bench_backpressure(tmp_path, seeds=2, base=Loop(devices=100, capacity=100.0,
                                                             seconds=20.0))
    mean, sd = report["rows"][0]["folded_over_capacity"]
    runs = [r["folded_over_capacity"] for r in report["rows"][0]["runs"]]
    assert mean == pytest.approx(sum(runs) / 2)
    assert sd == pytest.approx(abs(runs[0] - runs[1]) / 2 ** 0.5)
    assert f"{mean:.3f} ± {sd:.3f}" in capsys.readouterr().out
