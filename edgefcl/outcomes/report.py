"""Results: tables printed to the terminal, results.json, config.toml and PNG plots in the run
directory; `edgefcl report DIR` for a run directory or an aggregator state directory.

Every ± is the mean ± the sample standard deviation (ddof=1) over seeds (or clients)."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import ConfigError, RunConfig, apply, dump_toml, load_toml, run_entries
from edgefcl.data.types import DataError
from edgefcl.learn.drift import stream_lines
from edgefcl.learn.export import GLOBAL_FILE
from edgefcl.outcomes.metrics import CommStats, or_zero, per_task_final, pm, sample_std
from edgefcl.outcomes.results import RunResult
from edgefcl.support.statefiles import atomic_write, load_json, make_dir, save_tensors
from edgefcl.support.units import fmt_bytes

RESULTS, CONFIG, ROUNDS = "results.json", "config.toml", "rounds.jsonl"


def run_table(r: RunResult) -> str:
    """Per-task final accuracy, A, F, rounds and bytes of one run."""
    final = 100.0 * per_task_final(r.acc)
    head = " ".join(f"{'T' + str(i + 1):>6}" for i in range(len(final)))
    vals = " ".join(f"{v:6.1f}" for v in final)
    lines = [
        f"method {r.method}  seed {r.seed}  ({r.wall_s:.1f} s)",
        f"  final accuracy per task (%): {head}",
        f"  {'':28} {vals}",
        f"  A = {r.accuracy:.1f} %   F = {r.forgetting:.1f} %   rounds = {r.rounds}   "
        f"up = {fmt_bytes(r.comm.bytes_up)}   down = {fmt_bytes(r.comm.bytes_down)}"
        + (f"   per round: up {fmt_bytes(r.comm.bytes_up / r.rounds)}, "
           f"down {fmt_bytes(r.comm.bytes_down / r.rounds)}" if r.rounds else ""),
        *stream_lines(r.extra),
        *async_lines(r.extra),
    ]
    return "\n".join(lines)


def async_lines(extra: dict[str, Any]) -> list[str]:
    """The run-table line of an async run's rounds (`asynchrony` in results.json)."""
    a = extra.get("asynchrony")
    if not isinstance(a, dict) or not a.get("rounds"):
        return []
    stale = [int(k) for k in a.get("staleness", {})]
    return [f"  async: {a.get('updates_per_round', 0):.1f} updates a round, staleness "
            f"{a.get('staleness_mean', 0):.2f} (at most {max(stale, default=0)}), "
            f"{a.get('replaced', 0)} replaced, {a.get('dropped_stale', 0)} too stale, "
            f"{a.get('closed_gate', 0)} closed at the gate"]


def why_alone(r: RunResult) -> str:
    """Why a run's fleet never federated, as far as its aggregator's counters say: the
    updates it rejected, by reason, or that every client trained alone."""
    counters = r.extra.get("aggregator") or {}
    rejected = {k.removeprefix("rejected_"): v for k, v in counters.items()
                if k.startswith("rejected_") and isinstance(v, int) and v > 0}
    if not rejected:
        return "every client trained alone"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items(), key=lambda kv: -kv[1]))
    hint = (": values out of bounds usually mean a learning rate too large (--lr)"
            if rejected.keys() & {"range", "nonfinite"} else "")
    return f"the aggregator rejected its updates ({reasons}){hint}"


def summarize(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """Mean and sample std (ddof=1) of A, F, rounds and bytes per method over seeds."""
    by_method: dict[str, list[RunResult]] = defaultdict(list)
    for r in results:
        by_method[r.method].append(r)
    out = {}
    for m, rs in by_method.items():
        row = {"seeds": len(rs)}
        for key, vals in (("accuracy", [r.accuracy for r in rs]),
                          ("forgetting", [r.forgetting for r in rs]),
                          ("rounds", [r.rounds for r in rs]),
                          ("bytes_up", [r.comm.bytes_up for r in rs]),
                          ("wall_s", [r.wall_s for r in rs])):
            row[f"{key}_mean"] = float(np.mean(vals))
            row[f"{key}_std"] = sample_std(vals)
        out[m] = row
    return out


def compare_table(summary: dict[str, dict[str, float]]) -> str:
    """Methods side by side as mean ± sample std over seeds, like the paper's tables."""
    w = max([10, *map(len, summary)])
    lines = [f"{'method':<{w}} {'seeds':>5} {'A (%)':>14} {'F (%)':>14} {'rounds':>12} "
             f"{'bytes up':>10} {'time (s)':>9}"]
    for m, s in summary.items():
        rounds = (f"{s['rounds_mean']:.0f}" if not s["rounds_std"] else
                  pm(s["rounds_mean"], s["rounds_std"]))  # (async runs differ by seed)
        lines.append(
            f"{m:<{w}} {s['seeds']:>5} {pm(s['accuracy_mean'], s['accuracy_std']):>14} "
            f"{pm(s['forgetting_mean'], s['forgetting_std']):>14} "
            f"{rounds:>12} {fmt_bytes(s['bytes_up_mean']):>10} "
            f"{s['wall_s_mean']:9.1f}")
    lines.append("(mean ± sample standard deviation over seeds; the mean alone for one seed)")
    return "\n".join(lines)


# -- run directories -------------------------------------------------------------------------
def run_dir(out: Path, r: RunResult) -> Path:
    """The folder of one run of a --compare/--seeds directory."""
    return out / r.method.replace("/", "-") / f"seed{r.seed}"


def run_config(config: dict[str, Any]) -> RunConfig:
    """The configuration that reruns exactly this one run (one seed, no compare, no --out)."""
    d = json.loads(json.dumps(config))
    d.update(seeds=1, compare="", out="")
    return apply(RunConfig(), d)


def write_run(r: RunResult, out: Path) -> None:
    """results.json, config.toml (what `--config` reruns to the same global_sha256), the
    final global and the plots of one run."""
    make_dir(out)
    atomic_write(out / RESULTS, json.dumps(r.to_dict(), indent=1).encode(), fsync=False,
                 shared=True)
    atomic_write(out / CONFIG, dump_toml(run_config(r.config)).encode(), fsync=False,
                 shared=True)
    if r.global_state is not None:  # rebuilt by `edgefcl export --run` with model_spec
        save_tensors(out / GLOBAL_FILE, r.global_state, shared=True)
    plot_run(r, out)


def plot_run(r: RunResult, out: Path) -> None:
    plot_accuracy_matrix(r, out / "accuracy_matrix.png")
    plot_accuracy_over_tasks(r, out / "accuracy_over_tasks.png")


def write_summary(results: list[RunResult], out: Path) -> dict:
    """results.json with the summary and every run, and comparison.png (each run's own folder
    is written by `write_run` as it finishes)."""
    summary = summarize(results)
    make_dir(out)
    payload = {"summary": summary, "runs": [r.to_dict() for r in results]}
    atomic_write(out / RESULTS, json.dumps(payload, indent=1).encode(), fsync=False,
                 shared=True)
    plot_comparison(summary, out / "comparison.png")
    return summary


def result_from_dict(d: dict[str, Any], source: Path | str = "results.json") -> RunResult:
    """A RunResult read back from its results.json (without the global model); DataError
    naming `source` when `d` is not a run's record."""
    try:
        return _result(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{source}: not a run's results (missing or malformed: {e}); write it "
                        "again with edgefcl simulate --out") from None


def _result(d: dict[str, Any]) -> RunResult:
    comm = CommStats(dict(d.get("bytes_up_per_client", {})),
                     dict(d.get("bytes_down_per_client", {})),
                     list(d.get("bytes_up_per_round", [])),
                     list(d.get("bytes_down_per_round", [])))
    known = {"method", "seed", "accuracy", "forgetting", "accuracy_matrix", "rounds",
             "global_sha256", "wall_s", "config", "bytes_up", "bytes_down",
             "bytes_up_per_client", "bytes_down_per_client", "bytes_up_per_round",
             "bytes_down_per_round"}
    return RunResult(d["method"], int(d["seed"]), np.asarray(d["accuracy_matrix"]) / 100.0,
                     int(d["rounds"]), comm, d["global_sha256"], d["config"],
                     float(d.get("wall_s", 0.0)), {k: v for k, v in d.items() if k not in known})


def _sweep(cfg: RunConfig) -> list[tuple[str, int]]:
    """The (label, seed) of every run `cfg` makes, in order."""
    return [(label, seed) for label, _, _ in run_entries(cfg)
            for seed in range(cfg.seed, cfg.seed + cfg.seeds)]


class OtherOptions(ConfigError):
    """A run folder that holds runs of options other than the command's."""


def finished_runs(cfg: RunConfig, out: Path, several: bool) -> dict[tuple[str, int], RunResult]:
    """Runs of `cfg` already finished in `out` ((label, seed) -> result). A folder holding a
    run of another configuration is an error, never silently mixed in."""
    held = _held_runs(out)
    if held is not None and not several:
        raise OtherOptions(f"--resume: {out} holds a comparison of {len(held)} runs, not one "
                           "run; resume it with its --compare/--seeds (or a subset), or use "
                           "another --out")
    if several and (out / RESULTS).is_file() and held is None:
        raise OtherOptions(f"--resume: {out} holds one run, not a comparison; use another --out")
    done = {}
    for label, seed in _sweep(cfg):
        folder = out / label.replace("/", "-") / f"seed{seed}" if several else out
        if not (folder / RESULTS).is_file() or not (folder / CONFIG).is_file():
            continue
        d = load_json(folder / RESULTS)
        if "runs" in d:
            continue
        r = result_from_dict(d, folder / RESULTS)
        mine = _comparable(run_config(_expected(cfg, label, seed)))
        theirs = _comparable(load_toml(folder / CONFIG))
        if theirs != mine:
            raise OtherOptions(f"--resume: {folder} holds a run of another configuration "
                               f"({_first_difference(theirs, mine)}); use another --out or "
                               "the same options")
        r.method = label
        done[(label, seed)] = r
    for d in held or []:  # the summary's other runs are kept beside this sweep's: same options
        label, seed = str(d.get("method")), d.get("seed")
        if (label, seed) in done:
            continue
        try:
            if not isinstance(seed, int) or not isinstance(d.get("config"), dict):
                raise ConfigError("not a run's record")
            same = _comparable(run_config(d["config"])) == _comparable(run_config(_expected(
                dataclasses.replace(cfg, compare=label, seed=seed, seeds=1), label, seed)))
        except ConfigError:  # a config this version cannot read: not this sweep's options
            same = False
        if not same:
            raise OtherOptions(f"--resume: {out} holds a run of another configuration ({label} "
                               f"seed {seed}); use another --out or the same options")
    return done


def runs_replaced(cfg: RunConfig, out: Path, several: bool) -> int:
    """How many finished runs of `cfg` a run without --resume replaces in `out`; ConfigError
    when `out` holds runs of other options or files it cannot read, which such a run would
    replace unasked."""
    try:
        done = finished_runs(cfg, out, several)
        mine = set(_sweep(cfg))
        others = [f"{d.get('method')} seed {d.get('seed')}" for d in _held_runs(out) or []
                  if (d.get("method"), d.get("seed")) not in mine]
        if others:  # a summary of these and the others: this command's would drop them
            raise ConfigError(f"--out {out} holds runs this command does not run ("
                              f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                              "--resume keeps them in the summary, --overwrite replaces it")
        return len(done)
    except OtherOptions:
        raise ConfigError(f"--out {out} already holds runs of other options; add --overwrite "
                          "to replace them, or use another --out") from None
    except (ConfigError, DataError) as e:
        raise ConfigError(f"{e}; add --overwrite to replace it, or use another --out") from None


def _held_runs(out: Path) -> list[dict[str, Any]] | None:
    """The runs of the comparison summary in `out` (None: no summary there)."""
    path = out / RESULTS
    if not path.is_file():
        return None
    d = load_json(path)
    return d["runs"] if isinstance(d, dict) and isinstance(d.get("runs"), list) else None


def with_held_runs(results: list[RunResult], out: Path) -> tuple[list[RunResult], list[str]]:
    """`results` and the other runs the summary in `out` already holds, and those others'
    names ("er seed 2"): resuming a subset of a comparison keeps the rest of its summary
    (`finished_runs` checked that they have this sweep's options)."""
    mine = {(r.method, r.seed): r for r in results}
    held = [result_from_dict(d, out / RESULTS) for d in _held_runs(out) or []]
    extra = [f"{r.method} seed {r.seed}" for r in held if (r.method, r.seed) not in mine]
    merged = [mine.pop((r.method, r.seed), r) for r in held]  # the summary's order
    return merged + list(mine.values()), extra


def _expected(cfg: RunConfig, label: str, seed: int) -> dict[str, Any]:
    from edgefcl.build import for_method
    from edgefcl.outcomes.results import cfg_dict

    fed = next(f for lbl, _, f in run_entries(cfg) if lbl == label)
    method = next(m for lbl, m, _ in run_entries(cfg) if lbl == label)
    return cfg_dict(for_method(dataclasses.replace(cfg, fed=fed, compare=label), method),
                    method, seed)


def _first_difference(theirs: str, mine: str) -> str:
    """The first option two `_comparable` texts set apart: "[learn] memory_size 50 there, 20
    here"."""
    section = ""
    for a, b in zip(theirs.splitlines(), mine.splitlines(), strict=False):
        if a.startswith("["):
            section = f"{a} "
        if a != b:
            key, _, there = a.partition(" = ")
            return f"{section}{key} {there} there, {b.partition(' = ')[2]} here"
    return "other options"


def _comparable(cfg: RunConfig) -> str:
    """A run's options as text, for telling runs of other options apart (not its sweep's
    other entries, nor whether it printed progress)."""
    cfg.quiet, cfg.compare = False, ""
    return dump_toml(cfg)


# -- plots -----------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _seen(m: np.ndarray) -> np.ndarray:
    """Accuracy matrix with tasks not yet seen (i > t) blanked (NaN)."""
    m = np.array(m, np.float64)
    T = m.shape[0]
    m[np.triu_indices(T, 1)] = np.nan
    return m


def plot_accuracy_matrix(r: RunResult, path: Path) -> None:
    """Heat map of accuracy on task i (columns) after task t (rows), mean over clients; tasks
    not yet seen are blank."""
    plt = pyplot()
    m = _seen(100.0 * r.acc.mean(axis=0))
    T = m.shape[0]
    fig, ax = plt.subplots(figsize=(2.4 + 0.7 * T, 1.6 + 0.6 * T))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    im = ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=100, cmap=cmap)
    for t in range(T):
        for i in range(t + 1):
            ax.text(i, t, f"{m[t, i]:.0f}", ha="center", va="center",
                    color="white" if m[t, i] < 60 else "black", fontsize=8)
    ax.set_xticks(range(T), [f"T{i + 1}" for i in range(T)])
    ax.set_yticks(range(T), [f"T{t + 1}" for t in range(T)])
    ax.set_xlabel("evaluated on task")
    ax.set_ylabel("after training on task")
    K = r.acc.shape[0]
    ax.set_title(f"{r.method}, seed {r.seed}: test accuracy (%)\nmean over {K} client"
                 f"{'s' if K != 1 else ''}; A = {r.accuracy:.1f}, F = {r.forgetting:.1f}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy_over_tasks(r: RunResult, path: Path) -> None:
    """Accuracy on each task as later tasks are learned, mean over clients."""
    plt = pyplot()
    m = 100.0 * r.acc.mean(axis=0)
    T = m.shape[0]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i in range(T):
        ax.plot(range(i + 1, T + 1), m[i:, i], marker="o", label=f"task {i + 1}")
    ax.plot(range(1, T + 1), [m[t, : t + 1].mean() for t in range(T)], "k--", lw=2,
            label="mean over seen tasks")
    ax.set_xticks(range(1, T + 1))
    ax.set_xlabel("after training on task")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 105)
    K = r.acc.shape[0]
    ax.set_title(f"{r.method}, seed {r.seed}: accuracy per task as tasks arrive "
                 f"(mean over {K} client{'s' if K != 1 else ''})", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comparison(summary: dict[str, dict[str, float]], path: Path) -> None:
    """Bar chart of A and F per method, mean ± sample std over seeds."""
    plt = pyplot()
    methods = list(summary)
    x = np.arange(len(methods))
    fig, ax = plt.subplots(figsize=(3.0 + 1.1 * len(methods), 4.0))
    for off, key, label in ((-0.2, "accuracy", "A: final accuracy"),
                            (0.2, "forgetting", "F: forgetting")):
        sds = [summary[m][f"{key}_std"] for m in methods]
        ax.bar(x + off, [summary[m][f"{key}_mean"] for m in methods], 0.4,
               yerr=None if all(sd is None for sd in sds) else [or_zero(sd) for sd in sds],
               label=label, capsize=3)
    seeds = sorted({int(summary[m]["seeds"]) for m in methods})
    n = f"{seeds[0]} seed{'s' if seeds[0] != 1 else ''}" if len(seeds) == 1 else \
        f"{'/'.join(map(str, seeds))} seeds"
    ax.set_xticks(x, methods, rotation=20 if len(methods) > 4 else 0)
    ax.set_xlabel("method")
    ax.set_ylabel("% (mean ± sample std)" if seeds[-1] > 1 else "% (one seed)")
    low = min([0.0] + [summary[m][f"{k}_mean"] - or_zero(summary[m][f"{k}_std"])
                       for m in methods for k in ("accuracy", "forgetting")])
    ax.set_ylim(min(0.0, low - 3), 110)
    ax.axhline(0, color="black", lw=0.6)
    bars = "error bars: ± sample std (ddof=1)" if seeds[-1] > 1 else "no error bars"
    ax.set_title(f"A and F per method over {n}\nbars: mean, {bars}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The aggregator's round log (one JSON object per line); unreadable lines are skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_rounds(rounds: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per round: bytes received by the aggregator (bars) and the accuracy of the new global on
    held-out data (line, when the aggregator ran with --eval-data)."""
    plt = pyplot()
    x = [int(r["round"]) for r in rounds]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(x, [r.get("bytes_in", 0) / 1e3 for r in rounds], color="tab:gray", alpha=0.5,
           label="bytes received (kB)")
    ax.set_xlabel("round")
    ax.set_ylabel("kB received by the aggregator")
    handles, labels = ax.get_legend_handles_labels()
    accs = [(int(r["round"]), r["accuracy"]) for r in rounds if r.get("accuracy") is not None]
    if accs:
        ax2 = ax.twinx()
        ax2.plot(*zip(*accs, strict=True), color="tab:blue", marker=".",
                 label="global model accuracy on held-out data (%)")
        ax2.set_ylabel("accuracy (%)")
        ax2.set_ylim(0, 105)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=2, frameon=False)  # below the plot: inside, it covered the tallest bars
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- edgefcl report DIR ----------------------------------------------------------------------
def report_dir(path: Path) -> str:
    """The table of a run directory, a --compare/--seeds directory or an aggregator state
    directory; (re)writes its plots. Raises DataError for anything else."""
    if path.is_file():
        raise DataError(f"{path} is a file; pass its folder: edgefcl report {path.parent}")
    if not path.is_dir():
        raise DataError(f"{path}: no such directory")
    parts = []
    results = path / RESULTS
    if results.is_file():
        d = load_json(results)
        state = (path / ROUNDS).is_file() or (path / "state.json").is_file()
        if not isinstance(d, dict) or ("runs" not in d and "accuracy_matrix" not in d
                                       and not state):
            raise DataError(f"{path}: its results.json is neither a run's nor a comparison's "
                            "(written by edgefcl simulate --out or an aggregator)")
        if isinstance(d, dict) and "runs" in d:
            runs = [result_from_dict(r, results) for r in d["runs"]]
            summary = summarize(runs)
            plot_comparison(summary, path / "comparison.png")
            parts.append(compare_table(summary))  # (each run's own: report its folder)
        elif isinstance(d, dict) and "accuracy_matrix" in d:
            r = result_from_dict(d, results)
            plot_run(r, path)
            parts.append(run_table(r))
    if (path / ROUNDS).is_file() or (path / "state.json").is_file():
        from edgefcl.runtime.fleet_results import fleet_table

        rounds = read_rounds(path / ROUNDS)
        if rounds:
            plot_rounds(rounds, path / "rounds.png", f"fleet state {path.name}: bytes and "
                        "held-out accuracy of the global per round")
        parts.append(fleet_table(path, rounds))
    runs = sorted(path.glob(f"*/seed*/{RESULTS}"))
    if not parts and runs:  # a sweep stopped before its summary: the runs it finished
        found = [result_from_dict(load_json(f), f) for f in runs]
        summary = summarize(found)
        plot_comparison(summary, path / "comparison.png")
        parts += [compare_table(summary),
                  f"(a sweep without its summary: the {len(found)} runs it finished; "
                  "edgefcl simulate with the same options and --resume runs the rest)"]
    if not parts:
        inner = sorted({p.parent for name in (RESULTS, ROUNDS)
                        for p in [*path.glob(f"*/{name}"), *path.glob(f"*/*/{name}")]})
        hint = (f"; it holds one: edgefcl report {inner[0]}" if len(inner) == 1 else
                f"; it holds {len(inner)}, e.g. edgefcl report {inner[0]}" if inner else "")
        raise DataError(f"{path} is neither a run directory ({RESULTS}) nor an aggregator "
                        f"state directory ({ROUNDS}){hint}")
    return "\n".join(parts + [f"plots written to {path}/"])
