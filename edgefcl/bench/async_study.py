"""`edgefcl bench async`: the async study. Rules x timing profiles x datasets x seeds, every
run in process on the virtual clock (deterministic, fast), against lock-step on the same data;
writes a table (A, F, the lowest final task accuracy of any client, staleness, rounds), JSON
and a plot.

A rule is `NAME[/FIELD=VALUE...]`: a preset from `PRESETS` with [fed] fields changed, e.g.
`fedbuff/buffer=2/mix=0.7`. `lockstep` is the lock-step reference (profiles do not apply).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from edgefcl.bench.async_presets import PRESETS
from edgefcl.config import ConfigError, FedConfig, RunConfig, validate
from edgefcl.outcomes.metrics import or_zero, pm, sample_std
from edgefcl.outcomes.report import pyplot
from edgefcl.support.tomlfields import coerce_field

LOCKSTEP = "lock-step"
"""The profile column of lock-step runs (timing profiles do not apply to them)."""
DEFAULT_RULES = ("lockstep", "replace", "replace-ungated", "task-aware-ungated", "fedavg",
                 "fedasync-poly", "fedbuff", "fedbuff-lr1", "task-aware")
DEFAULT_PROFILES = ("homogeneous", "heterogeneous")
DEFAULT_DATASETS = ("digits", "mnist1d")


def rule_fields(spec: str) -> dict[str, object]:
    """The [fed] fields of rule `spec` (`NAME[/FIELD=VALUE...]`); ConfigError if unknown."""
    name, *changes = spec.split("/")
    if name not in PRESETS:
        raise ConfigError(f"unknown async rule '{name}'; choose from {', '.join(PRESETS)} "
                          "(then /FIELD=VALUE to change a [fed] field)")
    out = dict(PRESETS[name])
    for change in changes:
        key, eq, value = change.partition("=")
        if not eq:
            raise ConfigError(f"rule '{spec}': '{change}' is not FIELD=VALUE")
        try:
            typed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            typed = value  # a bare word: a name
        out[key] = coerce_field(FedConfig, key, typed, "fed", ConfigError, f"rule '{spec}': ")
    return out


def run_config(base: RunConfig, dataset: str, rule: str, profile: str, seed: int) -> RunConfig:
    """The config of one run of the study."""
    fed = dataclasses.replace(base.fed, **rule_fields(rule))
    cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, dataset=dataset),
                              fed=fed, profile=profile, seed=seed, seeds=1, compare="",
                              quiet=True, out="")
    validate(cfg)
    return cfg


def run_cell(base: RunConfig, dataset: str, rule: str, profile: str, seed: int) -> dict:
    """One run's record."""
    from edgefcl.sim.runs import simulate  # torch: imported in the worker, not by the CLI

    logging.getLogger("edgefcl").setLevel(logging.ERROR)  # rejections are counted, not printed
    cfg = run_config(base, dataset, rule, profile, seed)
    r = simulate(cfg)
    final = 100.0 * r.acc[:, -1, :]  # each client's accuracy per task after its last task
    stats = r.extra.get("asynchrony", {})
    return {"dataset": dataset, "rule": rule, "profile": profile, "seed": seed,
            "accuracy": r.accuracy, "forgetting": r.forgetting,
            "worst_task": float(final.min()), "rounds": r.rounds,
            "staleness_mean": stats.get("staleness_mean", 0.0),
            "updates_per_round": stats.get("updates_per_round", 0.0),
            "global_sha256": r.global_sha256, "wall_s": r.wall_s}


def _records(cells: list[tuple], jobs: int) -> Iterator[dict]:
    if jobs <= 1:
        for cell in cells:
            yield run_cell(*cell)
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "edgefcl.sim.runs"])
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(run_cell, *cell) for cell in cells]
        for f in as_completed(futures):
            yield f.result()


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (dataset, profile, rule): A, F as mean ± sample std, the lowest final task
    accuracy of any client in any run, runs with a task below 50 %, staleness, rounds."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["dataset"], r["profile"], r["rule"]), []).append(r)
    rows = []
    for (ds, profile, rule), rs in sorted(cells.items()):
        a, f = [r["accuracy"] for r in rs], [r["forgetting"] for r in rs]
        rows.append({"dataset": ds, "profile": profile, "rule": rule, "n": len(rs),
                     "accuracy": float(np.mean(a)), "accuracy_std": sample_std(a),
                     "forgetting": float(np.mean(f)), "forgetting_std": sample_std(f),
                     "worst_task": min(r["worst_task"] for r in rs),
                     "runs_below_50": sum(r["worst_task"] < 50 for r in rs),
                     "staleness_mean": float(np.mean([r["staleness_mean"] for r in rs])),
                     "rounds": float(np.mean([r["rounds"] for r in rs]))})
    return rows


def format_table(rows: list[dict]) -> str:
    """The study's table (markdown)."""
    lines = ["| dataset | profile | rule | n | A % | F % | worst task % | runs < 50 % | "
             "staleness | rounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['profile']} | {r['rule']} | {r['n']} | "
                     f"{pm(r['accuracy'], r['accuracy_std'])} | "
                     f"{pm(r['forgetting'], r['forgetting_std'])} | "
                     f"{r['worst_task']:.1f} | {r['runs_below_50']} | "
                     f"{r['staleness_mean']:.2f} | {r['rounds']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """A per rule, one panel per dataset, one bar per profile (error bars: sample std); the
    lock-step reference as a dashed line with its std as a band."""
    plt = pyplot()
    datasets = sorted({r["dataset"] for r in rows})
    sync = [r for r in rows if r["profile"] == LOCKSTEP]
    rows = [r for r in rows if r["profile"] != LOCKSTEP]
    profiles = sorted({r["profile"] for r in rows})
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.2), squeeze=False)
    width = 0.8 / max(len(profiles), 1)
    for ax, ds in zip(axes[0], datasets, strict=True):
        for j, profile in enumerate(profiles):
            cell = {r["rule"]: r for r in rows if r["dataset"] == ds and r["profile"] == profile}
            x = [i + j * width for i, rule in enumerate(rules) if rule in cell]
            ys = [cell[rule] for rule in rules if rule in cell]
            ax.bar(x, [r["accuracy"] for r in ys], width,
                   yerr=[or_zero(r["accuracy_std"]) for r in ys],
                   label=profile, capsize=2)
        ax.set_xticks([i + width * (len(profiles) - 1) / 2 for i in range(len(rules))])
        ax.set_xticklabels(rules, rotation=30, ha="right", fontsize=8)
        for r in (r for r in sync if r["dataset"] == ds):
            ax.axhline(r["accuracy"], ls="--", color="0.3", label=f"lock-step ({r['rule']})")
            sd = or_zero(r["accuracy_std"])
            ax.axhspan(r["accuracy"] - sd, r["accuracy"] + sd, color="0.85", zorder=0)
        ax.set_ylim(0, 100)  # bars from 0: a cut axis makes small gaps look large
        ax.set_ylabel("A (%)")
        ax.set_title(f"{ds}: final average accuracy, mean ± sample std")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_async(base: RunConfig, out: Path, datasets: list[str], rules: list[str],
                profiles: list[str], jobs: int = 1) -> list[dict]:
    """Run the study; writes bench_async.json, bench_async.md and bench_async.png to `out`."""
    for rule in rules:
        rule_fields(rule)  # every rule checked before the first run
    seeds = [base.seed + i for i in range(base.seeds)]
    cells = []
    for ds in datasets:
        for rule in rules:
            sync = PRESETS[rule.split("/")[0]].get("mode") == "sync"
            for profile in (["-"] if sync else profiles):
                cells += [(base, ds, rule, profile if not sync else "homogeneous", s)
                          for s in seeds]
    runs = []
    for i, rec in enumerate(_records(cells, jobs), 1):
        if PRESETS[rec["rule"].split("/")[0]].get("mode") == "sync":
            rec["profile"] = LOCKSTEP
        runs.append(rec)
        print(f"[{i}/{len(cells)}] {rec['dataset']} {rec['rule']} {rec['profile']} seed "
              f"{rec['seed']}: A {rec['accuracy']:.1f} worst task {rec['worst_task']:.1f}",
              file=sys.stderr, flush=True)
    rows = summarize(runs)
    table = format_table(rows)
    print(table)
    (out / "bench_async.md").write_text(table + "\n")
    (out / "bench_async.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    plot(rows, out / "bench_async.png")
    print(f"\nwritten {out / 'bench_async.json'}, bench_async.md, bench_async.png")
    return rows


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def run_from_args(args: argparse.Namespace, base: RunConfig, out: Path) -> int:
    """`edgefcl bench async` with its options (--datasets, --async-rules, --profiles, --jobs)."""
    out.mkdir(parents=True, exist_ok=True)
    bench_async(base, out, _csv(args.datasets) or list(DEFAULT_DATASETS),
                _csv(args.async_rules) or list(DEFAULT_RULES),
                _csv(args.profiles) or list(DEFAULT_PROFILES), args.jobs)
    return 0
