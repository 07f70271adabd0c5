"""Results: tables printed to the terminal, results.json and PNG plots in the run directory."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from edgefcl.learn.drift import stream_lines
from edgefcl.learn.export import GLOBAL_FILE
from edgefcl.metrics import per_task_final
from edgefcl.runtime.state import save_tensors
from edgefcl.simulate import RunResult


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


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
        f"up = {fmt_bytes(r.comm.bytes_up)}   down = {fmt_bytes(r.comm.bytes_down)}   "
        f"per round: up {fmt_bytes(r.comm.bytes_up / max(r.rounds, 1))}, "
        f"down {fmt_bytes(r.comm.bytes_down / max(r.rounds, 1))}",
        *stream_lines(r.extra),
    ]
    return "\n".join(lines)


def summarize(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """Mean and std of A, F, rounds and bytes per method over seeds."""
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
            row[f"{key}_std"] = float(np.std(vals))
        out[m] = row
    return out


def compare_table(summary: dict[str, dict[str, float]]) -> str:
    """Methods side by side as mean ± std, like the paper's tables."""
    w = max([10, *map(len, summary)])
    lines = [f"{'method':<{w}} {'A (%)':>14} {'F (%)':>14} {'rounds':>8} {'bytes up':>10} "
             f"{'time (s)':>9}"]
    for m, s in summary.items():
        lines.append(
            f"{m:<{w}} {s['accuracy_mean']:6.1f} ± {s['accuracy_std']:4.1f} "
            f"{s['forgetting_mean']:6.1f} ± {s['forgetting_std']:4.1f} "
            f"{s['rounds_mean']:8.0f} {fmt_bytes(s['bytes_up_mean']):>10} "
            f"{s['wall_s_mean']:9.1f}")
    return "\n".join(lines)


def write_run(r: RunResult, out: Path) -> None:
    """results.json and the plots of one run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r.to_dict(), indent=1))
    if r.global_state is not None:  # rebuilt by `edgefcl export --run` with model_spec
        save_tensors(out / GLOBAL_FILE, r.global_state)
    plot_accuracy_matrix(r, out / "accuracy_matrix.png")
    plot_accuracy_over_tasks(r, out / "accuracy_over_tasks.png")


def write_summary(results: list[RunResult], out: Path) -> dict:
    """Each run in its own folder, plus results.json with the summary and every run."""
    for r in results:
        write_run(r, out / r.method.replace("/", "-") / f"seed{r.seed}")
    summary = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"summary": summary, "runs": [r.to_dict() for r in results]}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    plot_comparison(summary, out / "comparison.png")
    return summary


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_matrix(r: RunResult, path: Path) -> None:
    """Heat map of accuracy on task i (columns) after task t (rows), mean over clients."""
    plt = _plt()
    m = 100.0 * r.acc.mean(axis=0)
    T = m.shape[0]
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * T, 0.8 + 0.6 * T))
    im = ax.imshow(m, vmin=0, vmax=100, cmap="viridis")
    for t in range(T):
        for i in range(T):
            ax.text(i, t, f"{m[t, i]:.0f}", ha="center", va="center",
                    color="white" if m[t, i] < 60 else "black", fontsize=8)
    ax.set_xticks(range(T), [f"T{i + 1}" for i in range(T)])
    ax.set_yticks(range(T), [f"after T{t + 1}" for t in range(T)])
    ax.set_title(f"{r.method}: accuracy (%)  A={r.accuracy:.1f} F={r.forgetting:.1f}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy_over_tasks(r: RunResult, path: Path) -> None:
    """Accuracy on each task as later tasks are learned, mean over clients."""
    plt = _plt()
    m = 100.0 * r.acc.mean(axis=0)
    T = m.shape[0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i in range(T):
        ax.plot(range(i + 1, T + 1), m[i:, i], marker="o", label=f"task {i + 1}")
    ax.plot(range(1, T + 1), [m[t, : t + 1].mean() for t in range(T)], "k--", lw=2,
            label="mean over seen tasks")
    ax.set_xlabel("after task")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{r.method}: accuracy per task over time")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comparison(summary: dict[str, dict[str, float]], path: Path) -> None:
    """Bar chart of A and F per method with std error bars."""
    plt = _plt()
    methods = list(summary)
    x = np.arange(len(methods))
    fig, ax = plt.subplots(figsize=(1.5 + 1.0 * len(methods), 3.5))
    for off, key, label in ((-0.2, "accuracy", "A"), (0.2, "forgetting", "F")):
        ax.bar(x + off, [summary[m][f"{key}_mean"] for m in methods], 0.4,
               yerr=[summary[m][f"{key}_std"] for m in methods], label=label, capsize=3)
    ax.set_xticks(x, methods)
    ax.set_ylabel("%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
