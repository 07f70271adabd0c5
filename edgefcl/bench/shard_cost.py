"""`edgefcl bench shard`: CPU cost per update of one aggregator vs a worker, and per partial of
the root, measured as process CPU time (time.process_time) through the daemons' message
handlers (decode, digest, admission, validation, fold, round close with its SQLite commit and
global encoding); no broker, so the numbers do not depend on what else the machine runs as
much as wall-clock rates do. paho's network thread (about 0.6 ms per dense update, measured
in issue #13) comes on top of each, on the process that receives the update.

Writes DIR/bench_shard.json and prints a table with the capacities these costs give: one
core folds 1000 / ms_single updates/s as one aggregator, and W workers W * 1000 / ms_worker
while the root, at ms_root per partial and one partial per worker and flush, keeps up.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from edgefcl.config import RunConfig, apply
from edgefcl.federation.messages import Update
from edgefcl.federation.shard import ShardWorker
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.links import NullLink, topics
from edgefcl.runtime.shard_root import RootDaemon
from edgefcl.runtime.shard_worker import WorkerDaemon
from edgefcl.transport.codec import encode
from edgefcl.transport.partials import encode_partial


def _cfg(clients: int, encoding: str, base: RunConfig) -> RunConfig:
    return apply(RunConfig(), {"fed": {"clients": clients, "min_clients": clients,
                                       "mode": "async", "burn_in": 0, "jump": 1,
                                       "encoding": encoding, "topk": base.fed.topk,
                                       "round_timeout": 1e9, "sample_cap": 10**6},
                               "mqtt": {"fleet": "bench"}, "quiet": True})


def _payloads(tensors: dict, encoding: str, clients: int, rounds: int) -> list[list[bytes]]:
    """rounds x clients sealed updates (one per client and round, seq = round + 1)."""
    return [[encode(Update(f"d{c:05d}", r, r + 1, 0, r + 1, 8, tensors, encoding, {0: 8}),
                    fleet="bench") for c in range(clients)] for r in range(rounds)]


def _cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def measure(initial: dict, tensors: dict, encoding: str, clients: int, rounds: int,
            workers: int, base: RunConfig) -> dict:
    cfg = _cfg(clients, encoding, base)
    t = topics(cfg.mqtt)
    with tempfile.TemporaryDirectory() as tmp:
        single = AggregatorDaemon(cfg, initial, Path(tmp) / "single")
        single.link = NullLink()
        for c in range(clients):
            single.agg.join(f"d{c:05d}")
        # every round's updates are based on the version the round starts from
        batches = _payloads(tensors, encoding, clients, rounds)
        cpu_single = _cpu(lambda: [single.handle(t.update(f"d{c:05d}"), p)
                                   for batch in batches for c, p in enumerate(batch)])
        assert single.agg.rounds == rounds, single.agg.counters
        single.store.close()

        root = RootDaemon(cfg, initial, Path(tmp) / "root",
                          workers=frozenset(f"w{j}" for j in range(workers)))
        root.link = NullLink()
        ws = []
        for j in range(workers):
            w = WorkerDaemon(cfg, f"w{j}")
            w.agg = ShardWorker(initial, cfg.fed, worker=f"w{j}")
            ws.append(w)
            root.agg.worker_online(w.id)
        cpu_workers = [0.0] * workers
        cpu_root = 0.0
        partial_bytes = 0
        for batch in batches:
            for c, p in enumerate(batch):
                j = c % workers
                cpu_workers[j] += _cpu(lambda j=j, c=c, p=p: ws[j].handle(
                    t.update(f"d{c:05d}"), p))
            for j, w in enumerate(ws):
                box: list = []
                cpu_workers[j] += _cpu(lambda w=w, box=box: box.append(
                    encode_partial(w.agg.flush(), fleet="bench")))
                partial_bytes = len(box[0])
                cpu_root += _cpu(lambda w=w, box=box: root.handle(t.partial(w.id), box[0]))
            g = root.agg.global_
            for w in ws:
                w.agg.set_global(g)
        assert root.agg.rounds == rounds, root.agg.counters
        root.store.close()
    n = clients * rounds
    ms_single = 1000 * cpu_single / n
    ms_worker = 1000 * sum(cpu_workers) / n
    ms_root = 1000 * cpu_root / (rounds * workers)
    return {"encoding": encoding, "clients": clients, "rounds": rounds, "workers": workers,
            "update_bytes": len(batches[0][0]), "partial_bytes": partial_bytes,
            "cpu_ms_per_update_single": ms_single, "cpu_ms_per_update_worker": ms_worker,
            "cpu_ms_per_partial_root": ms_root,
            "cpu_ms_root_per_update": 1000 * cpu_root / n}


KEYS = ("cpu_ms_per_update_single", "cpu_ms_per_update_worker", "cpu_ms_per_partial_root",
        "cpu_ms_root_per_update")


def bench_shard(cfg: RunConfig, out: Path, clients: int = 100, rounds: int = 3,
                workers: int = 2, repeats: int = 3) -> dict:
    """`repeats` measurements per payload; each cost is reported as the lowest of them (the
    one least disturbed by other processes) with every value in `<key>_all`."""
    from edgefcl.bench.fleet import demo_tensors, update_tensors
    from edgefcl.runtime.threads import one_blas_thread

    one_blas_thread()  # as the aggregator daemons run
    initial = demo_tensors(cfg)
    runs = []
    measure(initial, update_tensors(initial, "sparse", cfg), "sparse", 4, 1, workers, cfg)
    for payload in ("dense", "sparse"):  # after a warm-up: first calls pay for lazy imports
        tensors = update_tensors(initial, payload, cfg)
        reps = [measure(initial, tensors, payload, clients, rounds, workers, cfg)
                for _ in range(repeats)]
        r = reps[0] | {k: min(x[k] for x in reps) for k in KEYS} | {
            f"{k}_all": [x[k] for x in reps] for k in KEYS}
        runs.append(r)
        print(f"{payload:>6}: {r['update_bytes']:7d} B/update, single "
              f"{r['cpu_ms_per_update_single']:.2f} ms, worker "
              f"{r['cpu_ms_per_update_worker']:.2f} ms per update; root "
              f"{r['cpu_ms_per_partial_root']:.1f} ms per partial "
              f"({r['partial_bytes']} B)", flush=True)
    report = {"runs": runs, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_shard.json").write_text(json.dumps(report, indent=1, default=float))
    print(f"written {out / 'bench_shard.json'} (load average {report['load_average'][0]:.1f})")
    return report
