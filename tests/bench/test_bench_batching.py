"""`edgefcl bench batching`: whole runs with the clients one after another and stacked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edgefcl.bench.batching import bench_batching, parse_fleets, summarise, table
from edgefcl.config import ConfigError, RunConfig
from edgefcl.options import apply


def test_parse_fleets():
    assert parse_fleets(None, 5) == [5]
    assert parse_fleets("3, 32", 5) == [3, 32]
    for bad in ("3,x", "0", ","):
        with pytest.raises(ConfigError, match="--fleets"):
            parse_fleets(bad, 5)


def test_summarise_gives_mean_and_sample_std():
    runs = [{"wall_s": 1.0, "ms_per_client_batch": 10.0, "train_ms_per_client_batch": 4.0,
             "stacked_share": 1.0, "accuracy": 90.0, "forgetting": 2.0, "batches": 100},
            {"wall_s": 3.0, "ms_per_client_batch": 30.0, "train_ms_per_client_batch": 8.0,
             "stacked_share": 1.0, "accuracy": 94.0, "forgetting": 4.0, "batches": 100}]
    s = summarise(runs)
    assert s["wall_s"] == pytest.approx((2.0, 2 ** 0.5))  # ddof=1: sqrt(2 / 1)
    assert s["accuracy"] == pytest.approx((92.0, 8 ** 0.5))
    assert s["batches"] == 100


def test_bench_batching_runs_both_ways_and_writes_json(tmp_path, capsys):
    cfg = apply(RunConfig(), {"data": {"tasks": 2}, "fed": {"clients": 2}, "quiet": True})
    report = bench_batching(cfg, tmp_path, [2], repeats=1)
    saved = json.loads((tmp_path / "bench_batching.json").read_text())
    assert saved["rows"][0]["clients"] == 2
    runs = report["rows"][0]["runs"]
    off, on = runs["off"][0], runs["on"][0]
    assert off["stacked_share"] == 0.0 and on["stacked_share"] > 0.9
    # every client mini-batch learned either way; the same batches, in other float order
    assert off["batches"] == on["batches"] > 0
    assert off["ms_per_client_batch"] == pytest.approx(1000 * off["wall_s"] / off["batches"],
                                                       rel=1e-3)
    assert 0 < on["memory_ms_per_client_batch"] < on["ms_per_client_batch"]
    assert abs(off["accuracy"] - on["accuracy"]) < 10
    out = capsys.readouterr().out
    assert "off / on" in out and table(report["rows"]).splitlines()[2].rstrip().endswith("x")


@pytest.mark.slow
def test_compiling_the_step_is_paid_in_the_warm_up(tmp_path, capsys):
    cfg = apply(RunConfig(), {"data": {"tasks": 2}, "fed": {"clients": 2}, "quiet": True,
                              "learn": {"compile_step": "on"}})
    report = bench_batching(cfg, tmp_path, [2], repeats=1)
    row = report["rows"][0]
    assert report["compile_step"] and row["warmup_compile_s"] > 0
    assert "of which compiling the step" in capsys.readouterr().out
    # the timed runs find the step compiled (the same shapes, this process's cache)
    off = row["runs"]["off"][0]
    assert off["compile_s"] < row["warmup_compile_s"] / 10


def test_resume_keeps_the_fleet_sizes_measured_and_refuses_another_protocol(tmp_path,
                                                                          monkeypatch):
    from edgefcl.bench import batching

    ran = []

    def fake_run(cfg, clients, mode, seed):  # what _record reads of a run
        ran.append(clients)
        return SimpleNamespace(wall_s=1.0, extra={"batches": 10 * clients}, accuracy=50.0,
                               forgetting=5.0, global_sha256="x")

    monkeypatch.setattr(batching, "_run", fake_run)
    cfg = apply(RunConfig(), {"quiet": True})
    bench_batching(cfg, tmp_path, [2], repeats=1)
    ran.clear()
    report = bench_batching(cfg, tmp_path, [2, 3], repeats=1, resume=True)
    assert set(ran) == {3}  # 2 was kept
    assert [row["clients"] for row in report["rows"]] == [2, 3]
    saved = json.loads((tmp_path / "bench_batching.json").read_text())
    assert [row["clients"] for row in saved["rows"]] == [2, 3]
    ran.clear()
    report = bench_batching(cfg, tmp_path, [4], repeats=1, resume=True)
    assert set(ran) == {4}
    assert [row["clients"] for row in report["rows"]] == [2, 3, 4]  # none dropped
    saved = json.loads((tmp_path / "bench_batching.json").read_text())
    assert [row["clients"] for row in saved["rows"]] == [2, 3, 4]
    # --clients is what --fleets sets: not another configuration
    ran.clear()
    bench_batching(apply(cfg, {"fed": {"clients": 9}}), tmp_path, [2], repeats=1, resume=True)
    assert ran == []
    other = apply(RunConfig(), {"quiet": True, "learn": {"memory_size": 7}})
    with pytest.raises(ConfigError, match="another configuration"):
        bench_batching(other, tmp_path, [2], repeats=1, resume=True)
    bench_batching(other, tmp_path, [2], repeats=1)  # without --resume: overwritten
    (tmp_path / "bench_batching.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a bench_batching.json"):
        bench_batching(other, tmp_path, [2], repeats=1, resume=True)
