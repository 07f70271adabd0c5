"""The memory study's rule specs, statistics and bar check (edgefcl.bench.memory_study)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from edgefcl.bench.memory_study import (
    _records,
    bar_check,
    bench_memory,
    format_paired,
    format_table,
    paired,
    parse_rule,
    summarize,
)
from edgefcl.config import ConfigError, RunConfig


def test_parse_rule():
    r = parse_rule("bi:step+past@never")
    assert (r.method, r.selection, r.rank_past, r.rescore) == ("bi", "step", True, "never")
    r = parse_rule("cbr")
    assert (r.method, r.selection, r.rank_past, r.rescore) == ("cbr", None, False, None)
    r = parse_rule("bi:step@never~stream")
    assert (r.selection, r.rescore, r.share) == ("step", "never", "stream")
    assert parse_rule("cbr").share is None
    for bad in ("bi:nope", "bi+x", "nomethod", "bi@sometimes", "", "cbr~fast"):
        with pytest.raises(ConfigError):
            parse_rule(bad)


def _run(rule, seed, a, f, ds="d", pc=10):
    return {"dataset": ds, "per_class": pc, "rule": rule, "seed": seed, "accuracy": a,
            "forgetting": f, "wall_s": 1.0, "scored_per_batch": 0.0}


def test_summarize_uses_the_sample_std():
    rows = summarize([_run("er", 0, 80.0, 10.0), _run("er", 1, 84.0, 14.0),
                      _run("cbr", 0, 90.0, 5.0)])
    er = next(r for r in rows if r["rule"] == "er")
    assert er["accuracy"] == 82.0 and er["accuracy_std"] == pytest.approx(math.sqrt(8.0))
    assert er["forgetting_std"] == pytest.approx(math.sqrt(8.0)) and er["n"] == 2
    assert next(r for r in rows if r["rule"] == "cbr")["accuracy_std"] is None
    assert "| cbr | 90.0 | 5.0 |" in format_table(rows)  # one seed: the mean alone


def test_bar_check():
    rows = summarize([_run("er", 0, 80.0, 10.0), _run("cbr", 0, 85.0, 6.0),
                      _run("bi:a", 0, 84.0, 6.0), _run("bi:b", 0, 83.9, 5.0),
                      _run("bi:c", 0, 90.0, 6.1)])
    got = {b["rule"]: (b["a_ok"], b["f_ok"]) for b in bar_check(rows)}
    # A >= max(80, 85) - 1 = 84; F <= min(10, 6) = 6
    assert got == {"bi:a": (True, True), "bi:b": (False, True), "bi:c": (True, False)}


def test_paired_differences_are_taken_seed_by_seed():
    runs = [_run("cbr", 0, 88.0, 6.0), _run("cbr", 1, 91.0, 3.0), _run("cbr", 2, 70.0, 9.0),
            _run("bi", 0, 90.0, 5.0), _run("bi", 1, 92.0, 5.0), _run("er", 0, 80.0, 8.0)]
    got = {p["baseline"]: p for p in paired(runs)}
    # cbr: seeds 0 and 1 only (bi has no seed 2): dA = 2, 1; dF = -1, 2
    assert got["cbr"]["n"] == 2 and got["cbr"]["dA"] == 1.5 and got["cbr"]["dF"] == 0.5
    assert got["cbr"]["dA_std"] == pytest.approx(math.sqrt(0.5))
    assert got["cbr"]["dF_std"] == pytest.approx(math.sqrt(4.5))
    assert got["er"]["n"] == 1 and got["er"]["dA"] == 10.0 and got["er"]["dA_std"] is None
    assert "| bi | +10.0 / -3.0 |" in format_paired(paired(runs), "er")
    assert "| bi | +1.5 ± 0.7 / +0.5 ± 2.1 |" in format_paired(paired(runs), "cbr")


@pytest.mark.slow
def test_study_runs_writes_and_reuses(tmp_path, capsys):
    cfg = RunConfig()
    cfg.data.tasks, cfg.fed.clients = 2, 2
    bench_memory(cfg, tmp_path, ["digits"], [2], ["cbr", "bi:step"])
    report = json.loads((tmp_path / "bench_memory.json").read_text())
    assert {r["rule"] for r in report["runs"]} == {"cbr", "bi:step"}
    assert (tmp_path / "bench_memory.png").stat().st_size > 0
    assert "bi:step" in (tmp_path / "bench_memory.md").read_text()
    assert "| rule - cbr |" in (tmp_path / "bench_memory.md").read_text()
    assert [p["rule"] for p in report["paired"]] == ["bi:step"]
    bench_memory(cfg, tmp_path, ["digits"], [2], ["cbr", "bi:step"])
    assert "0 run(s) to do, 2 reused" in capsys.readouterr().out


@pytest.mark.slow
def test_jobs_in_worker_processes_give_the_same_runs(tmp_path):
    cfg = RunConfig()
    cfg.data.tasks, cfg.fed.clients, cfg.seeds = 2, 2, 1
    keep = ("dataset", "per_class", "rule", "seed", "accuracy", "forgetting", "global_sha256")

    def runs(out: Path, jobs: int) -> tuple[list[tuple], list[dict]]:
        bench_memory(cfg, out, ["digits"], [2], ["cbr", "bi"], jobs=jobs)
        report = json.loads((out / "bench_memory.json").read_text())
        rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in report["rows"]]
        return sorted(tuple(r[k] for k in keep) for r in report["runs"]), rows

    one = runs(tmp_path / "one", 1)
    assert len(one[0]) == 2 and runs(tmp_path / "two", 2) == one  # the rows in grid order too
    with pytest.raises(ConfigError, match="--jobs"):
        bench_memory(cfg, tmp_path / "none", ["digits"], [2], ["cbr"], jobs=0)


@pytest.mark.slow
def test_a_run_that_fails_in_a_worker_is_named_and_its_error_raised(capsys):
    good, bad = RunConfig(), RunConfig()
    good.data.tasks, good.fed.clients = 2, 2
    bad.learn.model = "no-such-model"
    cells = [(good, "digits", "digits", 10, 1, 0, parse_rule("er")),
             (bad, "digits", "digits", 10, 1, 1, parse_rule("cbr"))]
    got = []
    with pytest.raises(ConfigError, match="no-such-model"):
        for record in _records(cells, jobs=2):
            got.append(record)
    assert "the run digits M/class 1 cbr seed 1 failed" in capsys.readouterr().err
    assert [r["rule"] for r in got] == ["er"]  # the run beside it finished and came back


@pytest.mark.parametrize("value, message", [("5,x", "whole numbers"), ("5,-1", ">= 0")])
def test_bad_memory_sizes_are_refused(tmp_path, value, message):
    from edgefcl.bench.client_speed import run_bench

    with pytest.raises(ConfigError, match=message):
        run_bench("memory", RunConfig(), tmp_path, 1, study={"per_class": value})
