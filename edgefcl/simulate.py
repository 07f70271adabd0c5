"""In-process simulation: K clients and the aggregator in one process, lock-step, deterministic
for a seed. The networked runtime (`edgefcl.runtime`) drives the same objects over MQTT."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from edgefcl.build import (
    for_method,
    initial_global,
    initial_prototypes,
    make_client,
    prepare,
    use_cpu_threads,
)
from edgefcl.config import RunConfig
from edgefcl.data.streams import count_batches
from edgefcl.data.types import TaskData
from edgefcl.data.workload import client_stream
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.versions import GlobalHistory, delta_downlink, downlink_message
from edgefcl.learn.client import Client
from edgefcl.learn.drift import stream_report
from edgefcl.learn.export import architecture_spec, global_state
from edgefcl.learn.params import global_sha256
from edgefcl.metrics import CommStats, label_coverage
from edgefcl.results import RunResult, cfg_dict  # noqa: F401  (re-exported)
from edgefcl.transport import codec


def evaluate_all(client: Client, tasks: list[TaskData]) -> np.ndarray:
    """Accuracy of the client's model on every task's test data."""
    return np.array([client.evaluate(t.x_test, t.y_test) for t in tasks])


def simulate(cfg: RunConfig, method: str | None = None, seed: int | None = None,
             progress: Callable[[int, int, str], None] | None = None,
             observe: Callable[[Client], None] | None = None) -> RunResult:
    """Run one in-process lock-step simulation and return its result. `observe` is called
    with every client once it is built (benchmarks attach their probes)."""
    method = method or cfg.learn.method
    seed = cfg.seed if seed is None else seed
    cfg = for_method(cfg, method)
    use_cpu_threads(cfg.learn.threads)
    start = time.perf_counter()
    setup = prepare(cfg, seed)
    K, T = cfg.fed.clients, cfg.data.tasks
    clients = [make_client(cfg, setup, k, method, seed) for k in range(K)]
    if observe is not None:
        for c in clients:
            observe(c)
    streams = {c.cid: client_stream(cfg, setup.tasks[k], k, seed) for k, c in enumerate(clients)}
    agg = Aggregator(initial_global(cfg, setup), cfg.fed, batch_size=cfg.data.batch_size,
                     prototypes=initial_prototypes(setup, cfg.fed.encoding),
                     row_prior_sigma=cfg.learn.bayes_sigma)
    for c in clients:
        agg.join(c.cid)
    acc = np.zeros((K, T, T))
    coverage = np.zeros((2, K, T), np.int64)  # prototypes: known labels, unknown test samples
    comm = CommStats()
    total = max(sum(count_batches(t, cfg.data.batch_size)) for t in setup.tasks)
    active = list(range(K))
    tick = 0
    while active:
        tick += 1
        finished_tasks: list[tuple[int, int]] = []
        closed = None
        tick_up = 0
        for k in list(active):
            c = clients[k]
            batch = next(streams[c.cid], None)
            if batch is None:
                active.remove(k)
                closed = agg.leave(c.cid) or closed
                continue
            upd = c.step(batch)
            if upd is not None:
                size = encoded_size(upd, cfg)
                tick_up += size
                comm.sent(c.cid, size)
            closed = agg.submit(upd if upd is not None else c.tick()) or closed
            if batch.end_of_task:
                finished_tasks.append((k, batch.task))
        if closed is not None and closed.global_ is not None:
            comm.per_round_up.append(tick_up)
            _deliver(closed.global_, clients, comm, cfg, agg.history)
        for k, t in finished_tasks:
            acc[k, t] = evaluate_all(clients[k], setup.tasks[k])
            if clients[k].protos is not None:
                coverage[:, k, t] = clients[k].protos.coverage(
                    [task.y_test for task in setup.tasks[k]])
        if progress is not None:
            progress(min(tick, total), total, f"rounds {agg.rounds}")
    g = agg.global_
    return RunResult(method, seed, acc, agg.rounds, comm, global_sha256(g.tensors, g.prototypes),
                     cfg_dict(cfg, method, seed), time.perf_counter() - start,
                     {"scored_samples": int(sum(c.scored for c in clients)),
                      "batches": int(sum(c.batches for c in clients)),
                      "timings": dict(sum((c.timings for c in clients), Counter())),
                      "background_timings": dict(sum((c.background for c in clients),
                                                     Counter())),
                      "aggregator": dict(agg.counters),
                      "model_spec": architecture_spec(cfg.learn.model, setup.dataset.sample_shape,
                                               setup.dataset.n_classes, cfg.learn.hidden),
                      "labels": (list(g.prototypes.labels) if g.prototypes is not None
                                 else setup.dataset.labels),  # prototypes: library order
                      **label_coverage(coverage, clients[0].protos is not None),
                      **stream_report(clients)},
                     global_state=global_state(clients[0], g))


def _deliver(g: GlobalModel, clients: list[Client], comm: CommStats, cfg: RunConfig,
             history: GlobalHistory) -> None:
    """Send `g` to its participants: whole, or (sparse downlink) as the delta from the version
    each one holds; counts the bytes of what each one received."""
    by_id = {c.cid: c for c in clients}
    sent: dict[int, tuple[GlobalModel, int]] = {}  # held version -> (message, size)
    total = 0
    for cid in g.participants:
        c = by_id[cid]
        held = c.version if delta_downlink(cfg.fed) else -1
        if held not in sent:
            msg = downlink_message(g, history, held) if held >= 0 else g
            sent[held] = (msg, encoded_size(msg, cfg))
        msg, size = sent[held]
        c.apply_global(msg)
        comm.received(cid, size)
        total += size
    comm.per_round_down.append(total)


def encoded_size(msg: Update | GlobalModel, cfg: RunConfig) -> int:
    """Bytes the message occupies on the wire: its msgpack payload as the codec encodes it."""
    wire = "<f2" if cfg.mqtt.wire_dtype == "float16" else None
    return len(codec.encode(msg, fleet=cfg.mqtt.fleet, wire_dtype=wire))
