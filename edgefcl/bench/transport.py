"""`edgefcl bench transport`: the price of the network.

- lock-step MQTT run vs the in-process run of the same work (wall-time ratio, same result);
- aggregator ingest rate (updates/s, MB/s) for a 1M-parameter model through Mosquitto and the
  embedded broker (payloads above 1 MiB travel as chunks);
- aggregation memory for 10 vs 100 updates (running sums: it must not grow with clients).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

from edgefcl.config import FedConfig, MqttConfig, RunConfig
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.links import open_link, topics
from edgefcl.transport.broker import EmbeddedBroker, start_mosquitto
from edgefcl.transport.codec import encode

PARAMS = 1_000_000


def model_tensors(n_params: int = PARAMS, seed: int = 0) -> dict[str, np.ndarray]:
    """A synthetic model: a 1000 x 1000 weight matrix (4 MB float32) with a bias."""
    rng = np.random.default_rng(seed)
    side = int(np.sqrt(n_params))
    return {"w": rng.standard_normal((side, side), np.float32),
            "b": rng.standard_normal(side, np.float32)}


def wall_ratio(cfg: RunConfig, workdir: Path) -> dict:
    """In-process vs lock-step MQTT (embedded broker) on the same config and seed."""
    from edgefcl.runtime.fleet_processes import simulate_mqtt
    from edgefcl.sim.runs import simulate

    local = simulate(cfg)
    remote = simulate_mqtt(cfg, cfg.learn.method, cfg.seed, workdir=workdir)
    return {"inprocess_s": local.wall_s, "mqtt_s": remote.wall_s,
            "ratio": remote.wall_s / local.wall_s,
            "same_result": bool(remote.global_sha256 == local.global_sha256
                                and np.array_equal(remote.acc, local.acc))}


def ingest_rate(url: str, n_updates: int = 40, publishers: int = 4) -> dict:
    """Updates/s and MB/s that an aggregator daemon validates and folds in, end to end."""
    initial = model_tensors()
    fleet = f"bench-{secrets.token_hex(3)}"
    cfg = RunConfig(fed=FedConfig(clients=n_updates, mode="async", burn_in=1, jump=1,
                                  min_clients=n_updates + 1, round_timeout=1e9),
                    mqtt=MqttConfig(broker=url, fleet=fleet))
    state = Path(f"/tmp/edgefcl-bench-{fleet}")
    daemon = AggregatorDaemon(cfg, initial, state, status_every=1e9)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    while daemon.link is None or not daemon.link.is_connected:
        time.sleep(0.01)
    t = topics(cfg.mqtt)
    payloads = []
    for i in range(n_updates):
        tensors = {k: v + np.float32(i * 1e-3) for k, v in initial.items()}
        u = Update(f"d{i:03d}", 0, 1, 0, 1, 10, tensors)
        payloads.append((t.update(u.client), encode(u, fleet=fleet)))
    links = [open_link(cfg.mqtt, f"{fleet}-pub{j}", clean_start=True) for j in range(publishers)]
    start = time.perf_counter()

    def send(j: int) -> None:
        for topic, p in payloads[j::publishers]:
            links[j].publish(topic, p, wait=True)

    senders = [threading.Thread(target=send, args=(j,)) for j in range(publishers)]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    while daemon.agg.counters["accepted"] < n_updates:
        if time.perf_counter() - start > 300:
            raise RuntimeError(f"only {daemon.agg.counters['accepted']} updates ingested")
        time.sleep(0.002)
    elapsed = time.perf_counter() - start
    for link in links:
        link.close()
    daemon.stop_event.set()
    thread.join(10)
    shutil.rmtree(state, ignore_errors=True)
    mb = sum(len(p) for _, p in payloads) / 1e6
    return {"updates": n_updates, "payload_mb": mb / n_updates, "seconds": elapsed,
            "updates_per_s": n_updates / elapsed, "mb_per_s": mb / elapsed}


def aggregation_memory(counts: tuple[int, ...] = (10, 100)) -> dict:
    """Peak bytes allocated while an async Aggregator folds in N 1M-parameter updates."""
    initial = model_tensors()
    update_tensors = {k: v + 1 for k, v in initial.items()}
    out = {}
    for n in counts:
        agg = Aggregator(initial, FedConfig(clients=n, mode="async", burn_in=1, jump=1,
                                            min_clients=n + 1))
        tracemalloc.start()
        for i in range(n):
            agg.submit(Update(f"d{i:03d}", 0, 1, 0, 1, 10, update_tensors), now=0.0)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[str(n)] = {"peak_mb": peak / 1e6, "accepted": agg.counters["accepted"]}
    return out


def bench_transport(cfg: RunConfig, out: Path, repeats: int) -> dict:
    report: dict = {}
    print("aggregation memory (async running sums, 1M-parameter updates):")
    report["aggregation_memory"] = mem = aggregation_memory()
    for n, row in mem.items():
        print(f"  {n:>4} updates: peak {row['peak_mb']:.1f} MB")
    print("\naggregator ingest, 1M-parameter dense float32 updates (chunked at 1 MiB):")
    report["ingest"] = {}
    brokers = [("embedded (amqtt)", None)]
    if shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists():
        brokers.insert(0, ("mosquitto", "mosquitto"))
    for name, kind in brokers:
        if kind == "mosquitto":
            proc = start_mosquitto(allow_anonymous=True)
            try:
                row = ingest_rate(proc.url)
            finally:
                proc.stop()
        else:
            with EmbeddedBroker() as b:
                row = ingest_rate(b.url)
        report["ingest"][name] = row
        print(f"  {name:<18} {row['updates_per_s']:7.1f} updates/s  {row['mb_per_s']:7.1f} MB/s"
              f"  ({row['updates']} x {row['payload_mb']:.1f} MB)")
    print("\nlock-step MQTT (embedded broker, separate processes) vs in-process, "
          f"{cfg.data.dataset}, {cfg.fed.clients} clients:")
    run_cfg = dataclasses.replace(cfg, quiet=True, mqtt=dataclasses.replace(cfg.mqtt, broker=""))
    report["wall"] = w = wall_ratio(run_cfg, out / "fleet")
    print(f"  in-process {w['inprocess_s']:.1f} s, MQTT {w['mqtt_s']:.1f} s, ratio "
          f"{w['ratio']:.2f}x, identical result: {w['same_result']}")
    return report
