"""The memory study (`edgefcl bench memory`): selection rules x datasets x memory sizes x seeds.

Every run is one in-process lock-step simulation of the run configuration with the memory of
one rule. Runs go one after another, interleaved (for each dataset, size and seed, every rule in
turn), so that other load on the machine hits every rule alike; `jobs` > 1 runs that many at once
in worker processes (the same results, run for run; the wall times then include the contention
between them). Results are
written to JSON after every run and reused by a later call with the same out folder (a grid can
be extended without re-running what is there). The table gives A and F as mean ± sample std
(ddof=1) over seeds and the wall time per run.

A rule spec is `METHOD[:SELECTION][+past][@RESCORE][~SHARE]`: `er`, `cbr`, `bi:step`,
`bi:step+past` (past-task classes ranked by their cached scores too), `bi:bottom@on_change`,
`cbr~stream` (the current task's room paced by the stream, `--current-share`).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from edgefcl.config import CURRENT_SHARES, ConfigError, RunConfig
from edgefcl.data.loaders import write_digits28
from edgefcl.learn.methods import METHODS
from edgefcl.learn.selection import get_selection
from edgefcl.outcomes.metrics import or_zero, pm, sample_std
from edgefcl.sim.runs import simulate

DEFAULT_DATASETS = ("digits", "mnist1d", "digits28")
DEFAULT_PER_CLASS = (5, 10, 20, 50)
DEFAULT_RULES = ("er", "cbr", "bi", "bi:bottom@on_change", "bi:top", "bi:step@on_change",
                 "bi:mix", "bi:kcenter", "bi:herding", "bi:step+past")
"""The rules of the default grid (`bi` is the default memory; `bi:bottom@on_change` the
paper's)."""
BASELINES = tuple(sorted(name for name, m in METHODS.items() if m.baseline))
"""The rules the bar measures the others against (`Method.baseline`: cbr, er)."""
DIGITS28 = "digits28"
"""scikit-learn's 8x8 digits upscaled (bilinear) to 28x28 images: a small image workload."""


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """One memory rule of the study."""

    label: str
    method: str
    selection: str | None
    rank_past: bool
    rescore: str | None
    share: str | None = None


def parse_rule(spec: str) -> RuleSpec:
    """`METHOD[:SELECTION][+past][@RESCORE][~SHARE]` -> RuleSpec (ConfigError when
    malformed)."""
    s = spec.strip()
    rest, _, share = s.partition("~")
    rest, _, rescore = rest.partition("@")
    rest, plus, past = rest.partition("+")
    method, _, selection = rest.partition(":")
    if not method or (plus and past != "past"):
        raise ConfigError(f"bad rule '{spec}': use METHOD[:SELECTION][+past][@RESCORE][~SHARE]")
    if method not in METHODS:
        raise ConfigError(f"rule '{spec}': unknown method '{method}'")
    if selection:
        get_selection(selection)
    if rescore and rescore not in ("on_change", "always", "never"):
        raise ConfigError(f"rule '{spec}': rescore must be on_change, always or never")
    if share and share not in CURRENT_SHARES:
        raise ConfigError(f"rule '{spec}': ~SHARE must be equal or stream")
    return RuleSpec(s, method, selection or None, bool(plus), rescore or None, share or None)


def digits28_npz(folder: Path) -> Path:
    """scikit-learn's digits upscaled to 28x28 in `folder` (written on first use)."""
    path = folder / "digits28.npz"
    return path if path.exists() else write_digits28(path)


def dataset_spec(name: str, folder: Path) -> str:
    """The `--dataset` value of a study dataset name (digits28 is generated)."""
    return f"npz:{digits28_npz(folder)}" if name == DIGITS28 else name


def run_config(base: RunConfig, dataset: str, memory_size: int, rule: RuleSpec) -> RunConfig:
    """`base` with one study cell's dataset, memory size and rule."""
    learn = dataclasses.replace(base.learn, method=rule.method, memory_size=memory_size,
                                rank_past=rule.rank_past)
    if rule.selection:
        learn = dataclasses.replace(learn, selection=rule.selection)
    if rule.rescore:
        learn = dataclasses.replace(learn, rescore=rule.rescore)
    if rule.share:
        learn = dataclasses.replace(learn, current_share=rule.share)
    data = dataclasses.replace(base.data, dataset=dataset)
    return dataclasses.replace(base, data=data, learn=learn, compare="", quiet=True)


def _key(dataset: str, per_class: int, rule: str, seed: int) -> str:
    return f"{dataset}|{per_class}|{rule}|{seed}"


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1; None for one value)."""
    return float(np.mean(values)), sample_std(values)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (dataset, per_class, rule): A, F (mean ± sample std), wall s, n."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["dataset"], r["per_class"], r["rule"]), []).append(r)
    rows = []
    for (ds, pc, rule), rs in cells.items():
        a, a_sd = mean_std([r["accuracy"] for r in rs])
        f, f_sd = mean_std([r["forgetting"] for r in rs])
        w, _ = mean_std([r["wall_s"] for r in rs])
        rows.append({"dataset": ds, "per_class": pc, "rule": rule, "n": len(rs),
                     "accuracy": a, "accuracy_std": a_sd, "forgetting": f, "forgetting_std": f_sd,
                     "wall_s": w, "scored_per_batch": float(np.mean([r["scored_per_batch"]
                                                                    for r in rs]))})
    return rows


def bar_check(rows: list[dict]) -> list[dict]:
    """Per (dataset, per_class) and BI rule: does it meet F <= min(F_er, F_cbr) and
    A >= max(A_er, A_cbr) - 1 (on the means; er and cbr: the BASELINES)?"""
    out = []
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["dataset"], r["per_class"]), {})[r["rule"]] = r
    for (ds, pc), by_rule in cells.items():
        if any(b not in by_rule for b in BASELINES):
            continue
        f_ref = min(by_rule[b]["forgetting"] for b in BASELINES)
        a_ref = max(by_rule[b]["accuracy"] for b in BASELINES)
        for rule, r in by_rule.items():
            if rule in BASELINES:
                continue
            out.append({"dataset": ds, "per_class": pc, "rule": rule,
                        "f_ok": r["forgetting"] <= f_ref, "a_ok": r["accuracy"] >= a_ref - 1,
                        "dA": r["accuracy"] - a_ref, "dF": r["forgetting"] - f_ref})
    return out


def paired(runs: list[dict], baselines: tuple[str, ...] = BASELINES) -> list[dict]:
    """Per (dataset, per_class), rule and baseline: rule - baseline of A and F seed by seed
    (both ran the same streams), mean ± sample std over the seeds both ran: the spread of
    the comparison itself, in which the luck of a seed partly cancels."""
    by: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        by.setdefault((r["dataset"], r["per_class"], r["rule"]), {})[r["seed"]] = r
    out = []
    for (ds, pc, rule), mine in by.items():
        if rule in baselines:
            continue
        for base in baselines:
            ref = by.get((ds, pc, base), {})
            seeds = sorted(set(mine) & set(ref))
            if not seeds:
                continue
            da, da_sd = mean_std([mine[s]["accuracy"] - ref[s]["accuracy"] for s in seeds])
            df, df_sd = mean_std([mine[s]["forgetting"] - ref[s]["forgetting"] for s in seeds])
            out.append({"dataset": ds, "per_class": pc, "rule": rule, "baseline": base,
                        "n": len(seeds), "dA": da, "dA_std": da_sd, "dF": df, "dF_std": df_sd})
    return out


def format_paired(pairs: list[dict], baseline: str) -> str:
    """Markdown table of `paired` differences against `baseline`: a row per rule, a column
    per (dataset, per_class), cells "dA ± sd / dF ± sd"."""
    mine = [p for p in pairs if p["baseline"] == baseline]
    cols = list(dict.fromkeys((p["dataset"], p["per_class"]) for p in mine))
    lines = ["| rule - " + baseline + " | " + " | ".join(f"{d} {k}" for d, k in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for rule in dict.fromkeys(p["rule"] for p in mine):
        cell = {(p["dataset"], p["per_class"]): p for p in mine if p["rule"] == rule}
        lines.append(f"| {rule} | " + " | ".join(
            f"{pm(cell[c]['dA'], cell[c]['dA_std'], '+.1f')} / "
            f"{pm(cell[c]['dF'], cell[c]['dF_std'], '+.1f')}"
            if c in cell else "" for c in cols) + " |")
    return "\n".join(lines)


TABLE = {"data": "{dataset}", "M/class": "{per_class}", "rule": "{rule}",
         "A (%)": lambda r: pm(r["accuracy"], r["accuracy_std"]),
         "F (%)": lambda r: pm(r["forgetting"], r["forgetting_std"]),
         "wall s/run": "{wall_s:.1f}", "scored/batch": "{scored_per_batch:.1f}", "seeds": "{n}"}
"""The study table's columns: header -> cell format (or function) over a `summarize` row."""


def format_table(rows: list[dict]) -> str:
    """Markdown table of `summarize` rows."""
    lines = ["| " + " | ".join(TABLE) + " |", "|" + "---|" * len(TABLE)]
    lines += ["| " + " | ".join(cell(r) if callable(cell) else cell.format(**r)
                                for cell in TABLE.values()) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """A and F per rule, one panel pair per dataset, x = memory per class."""
    from edgefcl.outcomes.report import pyplot

    plt = pyplot()
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    sizes = sorted({r["per_class"] for r in rows})
    fig, axes = plt.subplots(2, len(datasets), figsize=(4.5 * len(datasets), 7.5),
                             squeeze=False)
    handles: dict[str, object] = {}
    for j, ds in enumerate(datasets):
        for ri, rule in enumerate(rules):
            rs = sorted((r for r in rows if r["dataset"] == ds and r["rule"] == rule),
                        key=lambda r: r["per_class"])
            if not rs:
                continue
            # one slot per memory size, rules side by side inside it
            x = [sizes.index(r["per_class"]) + 0.3 * (ri / max(len(rules) - 1, 1) - 0.5)
                 for r in rs]
            style = "--" if rule in BASELINES else "-"
            for i, k in enumerate(("accuracy", "forgetting")):
                sd = [or_zero(r[k + "_std"]) for r in rs]
                h = axes[i][j].errorbar(x, [r[k] for r in rs], yerr=sd, label=rule, ls=style,
                                        marker="o", capsize=2, lw=1, ms=4,
                                        color=f"C{ri % 10}")
                handles.setdefault(rule, h)
        axes[0][j].set_title(ds)
        axes[0][j].set_ylabel("A (%)")
        axes[1][j].set_ylabel("F (%)")
        axes[1][j].set_xlabel("memory per class")
        for i in range(2):
            axes[i][j].set_xticks(range(len(sizes)), [str(v) for v in sizes])
            axes[i][j].set_xlim(-0.5, len(sizes) - 0.5)
            axes[i][j].grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=8,
               ncol=min(len(handles), 6))
    fig.suptitle("memory study: mean ± sample std over seeds")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_cell(cfg: RunConfig, dataset: str, spec_ds: str, n_classes: int, per_class: int,
             seed: int, rule: RuleSpec) -> dict:
    """One run of the grid, as the record the JSON keeps."""
    r = simulate(run_config(cfg, spec_ds, per_class * n_classes, rule), seed=seed)
    n = max(r.extra["batches"], 1)
    return {"dataset": dataset, "per_class": per_class, "memory_size": per_class * n_classes,
            "rule": rule.label, "seed": seed, "accuracy": r.accuracy,
            "forgetting": r.forgetting, "wall_s": r.wall_s,
            "scored_per_batch": r.extra["scored_samples"] / n,
            "timings_ms": {k: 1000 * v / n for k, v in r.extra["timings"].items()},
            "global_sha256": r.global_sha256}


def _failed(cell: tuple) -> None:
    _, dataset, _, _, per_class, seed, rule = cell
    print(f"the run {dataset} M/class {per_class} {rule.label} seed {seed} failed:",
          file=sys.stderr, flush=True)


def _records(cells: list[tuple], jobs: int) -> Iterator[dict]:
    """`run_cell(*cell)` of every cell, in order with one job, as they finish with more (in
    worker processes forked from a server that imported torch once). A failed run stops the
    grid: the runs not started are cancelled, those running finish and are handed back, and
    the first error is raised at the end, after a line that names its run."""
    if jobs <= 1:
        for cell in cells:
            try:
                yield run_cell(*cell)
            except Exception:
                _failed(cell)
                raise
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "edgefcl.sim.runs"])
    failure: tuple[tuple, BaseException] | None = None
    pool = ProcessPoolExecutor(jobs, mp_context=ctx)
    try:
        futures = {pool.submit(run_cell, *cell): cell for cell in cells}
        for future in as_completed(futures):
            if future.cancelled():
                continue
            error = future.exception()
            if error is None:
                yield future.result()
            elif failure is None:
                failure = (futures[future], error)
                for other in futures:
                    other.cancel()
    finally:
        pool.shutdown(cancel_futures=True)  # also when the caller stops early (Ctrl-C)
    if failure is not None:
        _failed(failure[0])
        raise failure[1]


def bench_memory(cfg: RunConfig, out: Path, datasets: list[str], per_class: list[int],
                 rules: list[str], jobs: int = 1) -> dict:
    """Run the grid (reusing runs already in out/bench_memory.json; `jobs` runs at once),
    print the table, write JSON, the markdown table and the plot."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    specs = [parse_rule(r) for r in rules]
    path = out / "bench_memory.json"
    done: dict[str, dict] = {}
    if path.exists():
        for r in json.loads(path.read_text()).get("runs", []):
            done[_key(r["dataset"], r["per_class"], r["rule"], r["seed"])] = r
    seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
    cells = [(ds, pc, seed, spec) for ds in datasets for pc in per_class for seed in seeds
             for spec in specs]
    todo = [c for c in cells if _key(c[0], c[1], c[3].label, c[2]) not in done]
    print(f"memory study: {len(datasets)} dataset(s) x {len(per_class)} size(s) x "
          f"{len(specs)} rule(s) x {len(seeds)} seed(s); {len(todo)} run(s) to do, "
          f"{len(cells) - len(todo)} reused" + (f", {jobs} at once" if jobs > 1 else ""))
    spec_of = {ds: dataset_spec(ds, out) for ds in {c[0] for c in todo}}  # digits28 made once
    classes = {ds: 10 if ds in DEFAULT_DATASETS else _n_classes(spec)
               for ds, spec in spec_of.items()}
    t_start = time.perf_counter()
    work = [(cfg, ds, spec_of[ds], classes[ds], pc, seed, spec) for ds, pc, seed, spec in todo]
    for i, r in enumerate(_records(work, jobs)):
        done[_key(r["dataset"], r["per_class"], r["rule"], r["seed"])] = r
        elapsed = time.perf_counter() - t_start
        print(f"[{i + 1}/{len(todo)}] {r['dataset']} M/class {r['per_class']} {r['rule']} "
              f"seed {r['seed']}: A {r['accuracy']:.1f} F {r['forgetting']:.1f} "
              f"({r['wall_s']:.1f} s; {elapsed / 60:.1f} min so far)", flush=True)
        _write(path, cfg, done)
    runs = [done[k] for k in (_key(ds, pc, s.label, seed) for ds, pc, seed, s in cells)
            if k in done]  # in grid order, however the jobs finished
    rows = summarize(runs)
    report = _write(path, cfg, done, rows, paired(runs))
    table = format_table(rows)
    print("\nA and F: mean ± sample std (ddof=1) over seeds\n" + table)
    misses = [b for b in report["bar"] if not (b["f_ok"] and b["a_ok"])]
    bar = "bar (F <= min(F_er, F_cbr), A >= max(A_er, A_cbr) - 1)"
    print(f"\n{bar} met by rule:" if report["bar"] else
          f"\n{bar}: not checked, it needs the rules {' and '.join(BASELINES)} in the study")
    for rule in dict.fromkeys(b["rule"] for b in report["bar"]):
        mine = [b for b in report["bar"] if b["rule"] == rule]
        miss = [f"{b['dataset']}/{b['per_class']}" for b in misses if b["rule"] == rule]
        print(f"  {rule:<18} {len(mine) - len(miss)}/{len(mine)} cells"
              + (f"  (missed: {', '.join(miss)})" if miss else ""))
    pairs = [format_paired(report["paired"], b) for b in BASELINES
             if any(p["baseline"] == b for p in report["paired"])]
    if pairs:
        print("\npaired by seed (same streams), rule - baseline: A ± sd / F ± sd (ddof=1)")
        print("\n\n".join(pairs))
    (out / "bench_memory.md").write_text("\n\n".join([table, *pairs]) + "\n")
    if rows:
        plot(rows, out / "bench_memory.png")
        print(f"plot: {out / 'bench_memory.png'}")
    return report


def _n_classes(spec: str) -> int:
    from edgefcl.data.loaders import load_dataset

    return int(load_dataset(spec).n_classes)


def _write(path: Path, cfg: RunConfig, done: dict[str, dict],
           rows: list[dict] | None = None, pairs: list[dict] | None = None) -> dict:
    report = {"config": dataclasses.asdict(cfg), "runs": list(done.values()),
              "rows": rows or [], "bar": bar_check(rows or []), "paired": pairs or [],
              "note": "A, F in %; mean ± sample std (ddof=1) over seeds"}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    return report
