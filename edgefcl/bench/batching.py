"""`edgefcl bench batching`: whole in-process runs of the configured protocol with the fleet's
clients trained one after another (`--batch-clients off`) and stacked (`on`), for each fleet
size of `--fleets`, so that a researcher can see on their own machine (CPU or GPU) whether
`--batch-clients on` pays, and by how much.

For each fleet size untimed runs come first (the one-time costs of its shapes: torch's
kernels, the scoring graph's export, the compiled step of `--compile-step`), then, for every
seed of `--seed`/`--seeds`, `--repeats` trials, each running off and on in alternating order,
so that other load hits both alike. Per run: the wall time (`wall_s` of its results: the whole
run, evaluation included), the client mini-batches it learned (every client's), the wall time
per client mini-batch, the client threads' training and memory-update time per client
mini-batch, the share of client mini-batches that stepped stacked, A and F. Mean ± sample
std over the seeds and repeats; the table's last column is off / on (the speed-up of
stacking).

Writes DIR/bench_batching.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from edgefcl.config import ConfigError, RunConfig
from edgefcl.learn.compiled_step import compile_step
from edgefcl.outcomes.metrics import pm, sample_std
from edgefcl.outcomes.results import RunResult
from edgefcl.sim.runs import simulate

MODES = ("off", "on")


def parse_fleets(text: str | None, default: int) -> list[int]:
    """The fleet sizes of `--fleets` ("3,32"; None or empty: [default]); ConfigError on
    anything but whole numbers >= 1."""
    if not text:
        return [default]
    try:
        fleets = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--fleets takes client counts such as 3,32, got {text!r}") from None
    if not fleets or min(fleets) < 1:
        raise ConfigError(f"--fleets takes client counts >= 1, got {text!r}")
    return fleets


def _run(cfg: RunConfig, clients: int, mode: str, seed: int) -> RunResult:
    run_cfg = dataclasses.replace(
        cfg, quiet=True, fed=dataclasses.replace(cfg.fed, clients=clients),
        learn=dataclasses.replace(cfg.learn, batch_clients=mode))
    return simulate(run_cfg, seed=seed)


def _record(result: RunResult) -> dict:
    batches = int(result.extra.get("batches", 0))
    per = 1000.0 / max(batches, 1)
    return {"wall_s": round(result.wall_s, 4), "batches": batches,
            "ms_per_client_batch": round(result.wall_s * per, 4),
            "train_ms_per_client_batch": round(
                float(result.extra.get("timings", {}).get("train", 0.0)) * per, 4),
            "memory_ms_per_client_batch": round(
                float(result.extra.get("timings", {}).get("memory", 0.0)) * per, 4),
            "compile_s": round(float(result.extra.get("timings", {}).get("compile", 0.0)), 4),
            "stacked_share": round(int(result.extra.get("stacked_steps", 0)) / max(batches, 1),
                                   4),
            "accuracy": round(result.accuracy, 4), "forgetting": round(result.forgetting, 4),
            "global_sha256": result.global_sha256}


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return float(np.mean(values)), sample_std(values)


def summarise(runs: list[dict]) -> dict:
    """Mean and sample std of every number of `runs` (records of one fleet size and mode)."""
    keys = ("wall_s", "ms_per_client_batch", "train_ms_per_client_batch",
            "memory_ms_per_client_batch", "stacked_share", "accuracy", "forgetting")
    return {k: _mean_sd([r[k] for r in runs]) for k in keys
            if all(k in r for r in runs)} | {"batches": runs[0]["batches"]}  # an older
    # bench's file (--resume) has no memory column


def _protocol(cfg: RunConfig, repeats: int) -> dict:
    """What a resumed benchmark must share with the one it resumes: the run's sections of the
    configuration (stacking aside: the benchmark sets it), its seeds and repeats, torch."""
    learn = dataclasses.asdict(cfg.learn) | {"batch_clients": None}
    fed = dataclasses.asdict(cfg.fed) | {"clients": None}  # --fleets sets it
    protocol = {"data": dataclasses.asdict(cfg.data), "learn": learn, "fed": fed,
                "profile": cfg.profile, "seed": cfg.seed, "seeds": cfg.seeds,
                "repeats": repeats, "torch": torch.__version__}
    return json.loads(json.dumps(protocol))  # as the file holds it (tuples: lists)


def _resumed(path: Path, protocol: dict) -> dict[int, dict]:
    """The rows (by fleet size) of the benchmark of `protocol` that `path` holds; ConfigError
    when it holds another protocol's."""
    if not path.is_file():
        return {}
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot resume from {path}: {e}") from None
    if not isinstance(held, dict) or "protocol" not in held:
        raise ConfigError(f"cannot resume from {path}: not a bench_batching.json of this "
                          "version; use another --out, or drop --resume to overwrite it")
    if held["protocol"] != protocol:
        raise ConfigError(f"{path} holds a benchmark of another configuration; use another "
                          "--out, or drop --resume to overwrite it")
    return {row["clients"]: row for row in held.get("rows", [])}


def bench_batching(cfg: RunConfig, out: Path, fleets: list[int], repeats: int,
                   resume: bool = False) -> dict:
    """Run the protocol of `cfg` for every fleet size of `fleets` with stacking off and on,
    for each of its seeds `repeats` times (alternating); print the table and write
    out/bench_batching.json (again after each fleet size, so that a run cut short keeps what
    it measured). `resume`: keep every fleet size that file already holds for this protocol
    (those not in `fleets` too) and run only the others."""
    if repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_batching.json"
    protocol = _protocol(cfg, repeats)
    held = _resumed(path, protocol) if resume else {}
    trials = [(s, r) for s in range(cfg.seed, cfg.seed + cfg.seeds) for r in range(repeats)]
    compiled = compile_step(cfg.learn)
    report = {"device": cfg.learn.device, "compile_step": compiled,
              "dataset": cfg.data.dataset,
              "model": cfg.learn.model, "method": cfg.learn.method, "seed": cfg.seed,
              "seeds": cfg.seeds, "repeats": repeats, "torch": torch.__version__,
              "threads": cfg.learn.threads, "protocol": protocol, "rows": []}
    rows = dict(held)  # fleet size -> its row

    def save() -> None:
        report["rows"] = [rows[c] for c in sorted(rows)]
        path.write_text(json.dumps(report, indent=1))

    for n, k in enumerate(fleets):
        if k in held:
            print(f"{k} clients: kept from {path} ({n + 1}/{len(fleets)} fleet sizes)",
                  flush=True)
            continue
        # untimed: the one-time costs of this fleet's shapes (kernels, the scoring export;
        # compiling the step, which only the clients stepping alone use)
        warm = MODES[::-1] if compiled else ("on",)
        print(f"{k} clients ({n + 1}/{len(fleets)} fleet sizes): warm-up, stacking "
              f"{' and '.join(warm)} (untimed)...", flush=True)
        t0, compiling = time.perf_counter(), 0.0
        for mode in warm:
            compiling += _run(cfg, k, mode, cfg.seed).extra.get("timings", {}).get("compile", 0)
        print(f"  {time.perf_counter() - t0:.1f} s"
              + (f", of which compiling the step {compiling:.1f} s" if compiling else ""),
              flush=True)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for t, (seed, r) in enumerate(trials):
            for mode in MODES if t % 2 == 0 else MODES[::-1]:
                runs[mode].append(_record(_run(cfg, k, mode, seed)) | {"seed": seed,
                                                                       "trial": t})
                rec = runs[mode][-1]
                print(f"{k} clients, stacking {mode}, seed {seed}, repeat {r + 1}/{repeats}: "
                      f"{rec['wall_s']:.2f} s, {rec['ms_per_client_batch']:.2f} ms per client "
                      f"mini-batch, A {rec['accuracy']:.2f} %", flush=True)
        rows[k] = {"clients": k, "warmup_compile_s": round(compiling, 2), "runs": runs,
                   "summary": {m: summarise(runs[m]) for m in MODES}}
        save()
    save()
    print()
    print(table(report["rows"]))
    print(f"\nwritten {path}")
    return report


def table(rows: list[dict]) -> str:
    """The benchmark's table: per fleet size and mode, mean ± sample std over the repeats."""
    head = (f"{'clients':>7} {'stacking':>8} {'wall s':>15} {'ms / client batch':>19} "
            f"{'train ms':>15} {'memory ms':>15} {'stacked':>8} {'A %':>14} {'F %':>14} "
            f"{'off / on':>9}")
    lines, memory = [head], "memory_ms_per_client_batch"
    for row in rows:
        s = row["summary"]
        for mode in MODES:
            m = s[mode]
            ratio = (s["off"]["ms_per_client_batch"][0]
                     / max(s["on"]["ms_per_client_batch"][0], 1e-9))
            lines.append(
                f"{row['clients']:>7} {mode:>8} {_pm(m['wall_s'], 2):>15} "
                f"{_pm(m['ms_per_client_batch'], 2):>19} "
                f"{_pm(m['train_ms_per_client_batch'], 2):>15} "
                f"{_pm(m['memory_ms_per_client_batch'], 2) if memory in m else '-':>15} "
                f"{m['stacked_share'][0]:>8.2f} {_pm(m['accuracy'], 2):>14} "
                f"{_pm(m['forgetting'], 2):>14} "
                f"{f'{ratio:.2f}x' if mode == 'on' else '':>9}")
    return "\n".join(lines)


def _pm(value: tuple[float, float | None], digits: int) -> str:
    return pm(value[0], value[1], f".{digits}f")
