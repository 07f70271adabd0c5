"""`simulate --transport mqtt`: the aggregator, every client and the stream replayer as separate
processes talking through a broker (embedded unless one is given), collected into a RunResult
comparable with the in-process one."""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import numpy as np

from edgefcl.build import Setup, initial_global, make_client, prepare
from edgefcl.config import RunConfig, dump_toml
from edgefcl.data.streams import count_batches
from edgefcl.data.workload import client_id
from edgefcl.federation.aggregator import async_stats
from edgefcl.federation.label_rows import split_rows
from edgefcl.federation.messages import GlobalModel
from edgefcl.learn.drift import summarize_drift
from edgefcl.learn.export import architecture_spec, global_state
from edgefcl.learn.params import global_sha256
from edgefcl.outcomes.metrics import CommStats
from edgefcl.outcomes.results import RunResult, cfg_dict
from edgefcl.runtime.launcher import start_role, warm_up
from edgefcl.runtime.links import open_link
from edgefcl.runtime.supervisor import Deadline, FleetError, FleetProgress, Supervisor
from edgefcl.sim.profiles import matched_trace
from edgefcl.support.statefiles import load_json, load_tensors, save_tensors
from edgefcl.transport.broker import EmbeddedBroker


def simulate_mqtt(cfg: RunConfig, method: str, seed: int, workdir: Path | None = None,
                  progress: Callable[[int, int, str], None] | None = None,
                  timeout: float = 3600.0) -> RunResult:
    """Run one simulation as a real fleet of processes over MQTT.

    The roles are forked from a forkserver (runtime/launcher.py): a script that calls this
    needs the usual `if __name__ == "__main__":` guard."""
    start = time.perf_counter()
    if cfg.mqtt.broker:  # an unreachable broker is one clear error here, not one per process
        open_link(cfg.mqtt, f"{cfg.mqtt.fleet}-probe-{secrets.token_hex(3)}",
                  clean_start=True).close()
    warm_up()
    with ExitStack() as stack:
        mqtt = cfg.mqtt
        if not mqtt.broker:
            broker = stack.enter_context(EmbeddedBroker())
            mqtt = dataclasses.replace(mqtt, broker=broker.url)
        fleet = f"{mqtt.fleet}-{secrets.token_hex(3)}"
        mqtt = dataclasses.replace(mqtt, fleet=fleet)
        run_cfg = dataclasses.replace(
            cfg, mqtt=mqtt, seed=seed, seeds=1, compare="", out="",
            learn=dataclasses.replace(cfg.learn, method=method))
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefcl-")))
        if workdir.exists():
            shutil.rmtree(workdir)  # a fresh run: never resume an old aggregator state
        workdir.mkdir(parents=True)
        conf = workdir / "fleet.toml"  # without the password: the roles get it in memory
        conf.write_text(dump_toml(dataclasses.replace(
            run_cfg, mqtt=dataclasses.replace(mqtt, password=""))))
        state_dir, results_dir, logs = workdir / "aggregator", workdir / "clients", workdir / "logs"
        logs.mkdir(exist_ok=True)
        # forked from the forkserver, not exec'd: these arguments appear in no process list
        base = ["--config", str(conf), *(["--password", mqtt.password] if mqtt.password else [])]
        initial = workdir / "initial.npz"
        setup = prepare(run_cfg, seed)
        save_tensors(initial, initial_global(run_cfg, setup))
        procs = Supervisor(logs)
        procs.start("aggregator", partial(start_role, [
            "aggregator", *base, "--state-dir", str(state_dir), "--initial", str(initial),
            "--exit-when-done"]))
        for k in range(cfg.fed.clients):
            procs.start(client_id(k), partial(start_role, [
                "client", *base, "--index", str(k), "--results", str(results_dir)]))
        procs.start("replayer", partial(start_role, ["replay", *base]))
        try:
            streams = {client_id(k): sum(count_batches(t, cfg.data.batch_size))
                       for k, t in enumerate(setup.tasks)}
            _watch(run_cfg, procs, progress, timeout, streams)
        finally:
            procs.stop_all(grace=10)
        return _collect(run_cfg, method, seed, state_dir, results_dir,
                        time.perf_counter() - start, setup)


def _watch(cfg: RunConfig, procs: Supervisor,
           progress: Callable[[int, int, str], None] | None, timeout: float,
           streams: dict[str, int]) -> None:
    """Wait for every process to exit with 0, reporting progress from the status topics
    (`streams`: each client's batches)."""
    total = sum(streams.values())
    status = FleetProgress(cfg, total, streams) if progress is not None else None
    deadline = Deadline(timeout, lambda: "")
    orphaned_since: float | None = None
    try:
        while procs.running():
            procs.check()
            deadline.check()
            now = time.monotonic()
            if procs["aggregator"].poll() is not None:
                orphaned_since = orphaned_since or now
                if now - orphaned_since > 30:
                    raise FleetError("the aggregator exited but clients are still running; "
                                     f"see the logs in {procs.logs}")
            if progress is not None and status is not None:
                progress(status.batches, total, f"rounds {status.aggregator.get('rounds', 0)}")
            time.sleep(0.2)
        procs.check()
    finally:
        if status is not None:
            status.close()


def _collect(cfg: RunConfig, method: str, seed: int, state_dir: Path, results_dir: Path,
             wall: float, setup: Setup) -> RunResult:
    K, T = cfg.fed.clients, cfg.data.tasks
    client0 = make_client(cfg, setup, 0, method, seed)  # decodes the global as a client would
    setup_spec = architecture_spec(cfg.learn.model, setup.dataset.sample_shape,
                                   setup.dataset.n_classes, cfg.learn.hidden)
    acc = np.zeros((K, T, T))
    comm = CommStats()
    extra = {"scored_samples": 0, "batches": 0, "timings": {}}
    prequential, drift = {}, {}
    per_device: list[dict] = []
    coverage: dict[str, list] = {"known_labels": [], "unknown_label_test_samples": []}
    for k in range(K):
        r = json.loads((results_dir / f"{client_id(k)}.json").read_text())
        per_device.append(r)
        acc[k] = np.asarray(r["accuracy_matrix"])
        for key, rows in coverage.items():
            if key in r:  # prototype head
                rows.append(r[key])
        comm.sent(r["client"], r["bytes_up"])
        comm.received(r["client"], r["bytes_down"])
        extra["scored_samples"] += r["scored_samples"]
        extra["batches"] += r["batches"]
        for key, v in r["timings"].items():
            extra["timings"][key] = extra["timings"].get(key, 0.0) + v
        prequential.update(r.get("prequential_per_client", {}))
        if "drift" in r:
            drift[r["client"]] = r["drift"]
    extra.update({key: rows for key, rows in coverage.items() if len(rows) == K})
    if prequential:
        extra["prequential_accuracy"] = float(np.mean(list(prequential.values())))
        extra["prequential_per_client"] = prequential
    if drift:
        per_client = {cid: d["per_client"][cid] for cid, d in drift.items()}
        extra["drift"] = summarize_drift(per_client, next(iter(drift.values()))["signal"])
    state = load_json(state_dir / "state.json")
    tensors, library = split_rows(load_tensors(state_dir / "global.npz"))
    extra["aggregator"] = state.get("counters", {})
    rounds_log = state_dir / "rounds.jsonl"
    closed_at: dict[str, float] = {}
    for line in rounds_log.read_text().splitlines() if rounds_log.exists() else []:
        entry = json.loads(line)
        closed_at[str(entry["version"])] = float(entry.get("time", 0.0))
        comm.per_round_up.append(entry["bytes_in"])
        comm.per_round_down.append(entry["global_bytes"] * K)  # every client receives it
    if cfg.fed.mode == "async":  # the counters the async simulator reports, and its profile
        extra["asynchrony"] = async_stats(extra["aggregator"])
        extra["timing_trace"] = matched_trace(per_device, closed_at)
    extra["model_spec"] = setup_spec
    extra["labels"] = (list(library.labels) if library is not None  # prototypes: library order
                       else setup.dataset.labels)
    final = GlobalModel(state["version"], tensors, prototypes=library)
    return RunResult(method, seed, acc, int(state["rounds"]), comm,
                     global_sha256(tensors, library),
                     cfg_dict(cfg, method, seed), wall, extra,
                     global_state=global_state(client0, final))
