"""The lock-step in-process simulation (the paper's Algorithm 1): K clients and the aggregator
in one process, deterministic for a seed. `edgefcl.sim.runs.simulate` picks it or the async
one; the networked runtime (`edgefcl.runtime`) drives the same objects over MQTT."""

from __future__ import annotations

import logging
import time
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
from edgefcl.data.workload import client_stream
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import GlobalModel
from edgefcl.federation.versions import GlobalHistory, delta_downlink, downlink_message
from edgefcl.learn.batched import FleetTrainer, batch_clients, why_alone
from edgefcl.learn.client import Client
from edgefcl.outcomes.metrics import CommStats
from edgefcl.outcomes.results import RunResult
from edgefcl.sim.outcome import encoded_size, evaluate_all, run_result

log = logging.getLogger(__name__)


def simulate_lockstep(cfg: RunConfig, method: str, seed: int,
                      progress: Callable[[int, int, str], None] | None = None,
                      observe: Callable[[Client], None] | None = None) -> RunResult:
    """Run one lock-step simulation of `method` with `seed` and return its result."""
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
    total = sum(sum(count_batches(t, cfg.data.batch_size)) for t in setup.tasks)  # the fleet's
    done = 0  # mini-batches, as the async and networked runs count them
    active = list(range(K))
    trainer = FleetTrainer() if batch_clients(cfg.learn) else None
    if trainer is not None and (why := why_alone(clients[0])) is not None:
        log.warning("batch-clients: %s, so its clients train one after another", why)
    while active:
        finished_tasks: list[tuple[int, int]] = []
        closed = None
        tick_up = 0
        batches = {k: next(streams[clients[k].cid], None) for k in active}
        stepping = [k for k in active if batches[k] is not None]
        if trainer is not None:  # one stacked step; the aggregator hears them in order below
            updates = dict(zip(stepping, trainer.step([clients[k] for k in stepping],
                                                      [batches[k] for k in stepping]),
                               strict=True))
        for k in list(active):
            c = clients[k]
            batch = batches[k]
            if batch is None:
                active.remove(k)
                closed = agg.leave(c.cid) or closed
                continue
            upd = c.step(batch) if trainer is None else updates[k]
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
        if trainer is not None and finished_tasks:  # stacked across the clients
            tests = [[(task.x_test, task.y_test) for task in setup.tasks[k]]
                     for k, _ in finished_tasks]
            scores = trainer.evaluate([clients[k] for k, _ in finished_tasks], tests)
        for n, (k, t) in enumerate(finished_tasks):
            acc[k, t] = evaluate_all(clients[k], setup.tasks[k]) if trainer is None else scores[n]
            if clients[k].protos is not None:
                coverage[:, k, t] = clients[k].protos.coverage(
                    [task.y_test for task in setup.tasks[k]])
        done += len(stepping)
        if progress is not None:
            progress(min(done, total), total, f"rounds {agg.rounds}")
    stacked = {} if trainer is None else trainer.counts()
    return run_result(cfg, method, seed, setup, clients, agg, acc, coverage, comm, start,
                      **stacked)


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
