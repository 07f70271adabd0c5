"""The client benchmark's view-stability statistics (edgefcl.bench), hand-computed."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from edgefcl.bench.client_speed import bare_train_ms, log_scores, spearman, view_stability
from edgefcl.build import prepare
from edgefcl.config import RunConfig
from edgefcl.options import apply
from edgefcl.sim.runs import simulate


def test_spearman():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, 10 * a) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # rank differences 1, 1, 1, 1 -> 1 - 6 * 4 / (4 * 15) = 0.6
    assert spearman(a, torch.tensor([2.0, 1.0, 4.0, 3.0])) == pytest.approx(0.6)
    assert math.isnan(spearman(a, torch.ones(4)))  # constant: undefined


def test_view_stability_compares_view_prefixes_with_all_views():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 6, 3, generator=g)
    repeated = torch.cat([z, z])  # views 2, 3 repeat views 0, 1: 2 views score as all 4
    # the 2-candidate call is skipped; the retest's halves are the same 4 views: rho 1
    s = view_stability([repeated, torch.randn(4, 2, 3)], "bi",
                       retest=[torch.cat([repeated, repeated]), torch.randn(6, 5, 3)])
    assert (s["views"], s["calls"], s["mean_candidates"]) == (4, 1, 6.0)
    assert [r["views"] for r in s["prefixes"]] == [2, 3]
    assert s["prefixes"][0]["median_rho"] == pytest.approx(1.0)
    assert s["prefixes"][0]["share_ge_0.9"] == 1.0
    assert s["retest"]["calls"] == 1 and s["retest"]["median_rho"] == pytest.approx(1.0)
    # the second half negated: another ranking
    assert view_stability([repeated], "bi", retest=[torch.cat([repeated, -repeated])])[
        "retest"]["median_rho"] < 1.0


def test_logging_the_scores_leaves_the_run_unchanged():
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=2))
    logs: list[torch.Tensor] = []
    logged = simulate(cfg, method="bi", seed=0, observe=log_scores(logs))
    plain = simulate(cfg, method="bi", seed=0)
    assert logged.global_sha256 == plain.global_sha256
    assert logs and all(z.ndim == 3 and z.shape[0] == 12 for z in logs)


def test_the_bare_training_step_trains_a_copy_of_the_initial_model():
    cfg = RunConfig()
    setup = prepare(cfg, 0)
    before = {k: v.clone() for k, v in setup.initial.state_dict().items()}
    assert bare_train_ms(cfg, setup, seconds=0.0) > 0  # one mini-batch at least
    after = setup.initial.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_cost_vs_cbr_reports_ratios_and_view_stability(tmp_path):
    from edgefcl.bench.client_speed import cost_vs_cbr

    # two clients and two tasks of the demo data: the 28x28 configuration runs the same code
    # on another dataset (generated and tested in test_bench_memory), at 4x the time
    cfg = apply(RunConfig(), {"seeds": 1, "fed": {"clients": 2}, "data": {"tasks": 2}})
    report = cost_vs_cbr(cfg, tmp_path, configs=("demo",))
    assert set(report) == {"demo"}
    for name in report:
        r = report[name]
        assert r["ratios"]["wall"] > 0 and set(r["runs"]) == {"cbr", "bi"}
        assert r["bare_train_ms"] > 0 and r["ratios"]["cbr_train_vs_bare_torch"] > 0
        assert r["bare_train_ms_each"] == [r["bare_train_ms"]]  # one seed: one timing
        bi, ratios = r["runs"]["bi"], r["ratios"]
        assert ratios["step_vs_bare_torch"] == pytest.approx(bi["step"] / r["bare_train_ms"])
        assert bi["step_each"] == [pytest.approx(bi["step"])]  # one seed: its own step
        assert 0 < bi["train_each"][0] < bi["step_each"][0]
        s = r["view_stability"]
        assert s["views"] == 12 and s["calls"] > 0 and len(s["prefixes"]) == 10
        assert -1.0 <= s["retest"]["median_rho"] <= 1.0


BLOCK_BROKER_PACKAGES = """
import sys
from importlib.abc import MetaPathFinder

class NoBrokerPackages(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("amqtt", "paho"):
            raise ImportError(f"{name} is not installed on this machine")
        return None

sys.meta_path.insert(0, NoBrokerPackages())
"""


def test_bench_client_and_the_memory_study_need_no_broker_packages(tmp_path):
    """On a machine without amqtt and paho (a GPU box for studies), `edgefcl bench client`,
    `bench memory` and `bench batching` (through the command line) get as far as their own
    work (stubbed here: the real runs are timed elsewhere), and the transport bench says what
    it misses."""
    import subprocess
    import sys

    script = BLOCK_BROKER_PACKAGES + f"""
from pathlib import Path
import edgefcl.bench.client_speed as bc
import edgefcl.bench.memory_study as bm
from edgefcl.config import RunConfig
from edgefcl.options import apply
bc.bench_client = lambda cfg, out, repeats: {{"stub": True}}
bm.bench_memory = lambda *a, **k: None
out = Path({str(tmp_path)!r})
assert bc.run_bench("client", RunConfig(), out, 1) == 0
assert bc.run_bench("memory", RunConfig(), out, 1, study={{}}) == 0
import edgefcl.bench.batching as bb
from edgefcl.cli import main
bb.bench_batching = lambda cfg, out, fleets, repeats, resume: print("batching", fleets,
                                                                   repeats, resume)
assert main(["bench", "batching", "--fleets", "2,4", "--repeats", "1", "--out", str(out),
             "--resume"]) == 0
try:
    bc.run_bench("transport", RunConfig(), out, 1)
except ImportError as e:
    print("transport:", e)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "transport: amqtt" in done.stdout or "transport: paho" in done.stdout
    assert "batching [2, 4] 1 True" in done.stdout


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bare_step_references_report_each_variant(compiled):
    from edgefcl.bench.bare_step import bare_step_refs

    cfg = RunConfig()
    refs = bare_step_refs(cfg, prepare(cfg, 0), seconds=0.2, clients=3,
                          compile_step=compiled)
    assert refs["eager_ms"] > 0 and refs["stacked_clients"] == 3
    assert ("compiled_ms" in refs) == compiled  # --compile-step's
    if compiled:
        assert refs["compile_s"] is None or refs["compile_s"] > 0  # None: compiled before
        again = bare_step_refs(cfg, prepare(cfg, 0), seconds=0.2, clients=3)
        assert again["compile_s"] is None  # this process compiled it: no compile time to show
        assert again["stacked_compile_s"] is None
    assert refs["stacked_ms_per_client"] > 0  # BatchNorm models too (the default is a CNN)
    assert ("stacked_compiled_ms_per_client" in refs) == compiled
    assert "fused_ms" in refs or "fused_skipped" in refs
