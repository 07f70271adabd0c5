"""`edgefcl bench fuzz`: mutated payloads through the aggregator's and a device's message
handlers, as a device with a valid credential could send them.

Four kinds of mutation of a corpus of valid payloads (updates and globals carrying prototype
libraries, ticks, statuses, commands):
- bytes: flips, cuts, insertions and appended bytes (mostly stopped by structure or digest);
- fields: one field, at any depth, replaced by junk (huge or negative numbers, wrong types,
  nested bombs, long lists, NaN / 1e30 / negative-variance tensors, thousands of classes), then
  sealed again with a valid digest, as an attacker's own encoder would;
- tables: a prototype library's label names (too long, empty, duplicated, not strings, too
  many, one missing or extra), counts (negative, past MAX_COUNT, floats, wrong length) or rows
  (NaN, 1e30, wrong width or dtype), sealed again;
- attacks: the fixed payloads of the trust-boundary issue (nesting bomb, 10^5 zero-size
  tensors, control on a device topic, num_samples 10^12, seq 2^64-1, ...).
Each payload goes to a random topic of the fleet. The report counts escaped exceptions (an
exception out of the handler, or a failure the handler had to count as `internal`), the slowest
payload (timed without tracemalloc), the peak of Python allocations (tracemalloc, first 10^4
payloads), the growth of resident memory and the rejections by reason.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from edgefcl.config import RunConfig, apply
from edgefcl.data.labels import MAX_LABEL_CHARS, MAX_LABELS
from edgefcl.data.types import Batch
from edgefcl.federation.label_rows import MAX_COUNT, LabelRows, check_rows
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.runtime.heap import freeze_startup_heap
from edgefcl.runtime.links import NullLink
from edgefcl.transport import integrity
from edgefcl.transport.codec import Message, encode, encode_batch, encode_tensor

FLEET = "fuzz"
CLIENTS = ["d0", "d1", "d2"]


def _pack(m: Any) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def _junk(rng: np.random.Generator) -> Any:
    """One junk value an attacker might put in any field."""
    choice = int(rng.integers(16))
    if choice == 0:
        return int(rng.choice([2**63 - 1, -(2**63), 2**64 - 1, 10**12, -1, 0]))
    if choice == 1:
        return float(rng.choice([np.nan, np.inf, -1e300, 1e30]))
    if choice == 2:
        return "x" * int(rng.integers(0, 5000))
    if choice == 3:
        return bytes(int(rng.integers(0, 5000)))
    if choice == 4:
        return list(range(int(rng.integers(0, 3000))))
    if choice == 5:
        inner: Any = 1
        for _ in range(int(rng.integers(5, 600))):
            inner = {"x": inner}
        return inner
    if choice == 6:
        return {int(i): 1 for i in range(int(rng.integers(1, 3000)))}
    if choice == 7:
        return {"dtype": "<f4", "shape": [int(rng.integers(0, 1 << 30))], "data": b""}
    if choice == 8:
        return {"dtype": "<f4", "shape": [2], "data": np.array([np.nan, 1e30], "<f4").tobytes()}
    if choice == 9:
        return {"dtype": "<i8", "shape": [], "data": bytes(8)}
    if choice == 10:
        return {f"t{i}": {"dtype": "<f4", "shape": [0], "data": b""}
                for i in range(int(rng.integers(1, 5_000)))}
    if choice == 11:
        return None
    if choice == 12:
        return True
    if choice == 13:
        return [[[[[]]]]]
    if choice == 14:
        return {"command": "stop"}
    return int(rng.integers(-10, 10))


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


def _field_mutation(payload: bytes, rng: np.random.Generator) -> bytes:
    m = msgpack.unpackb(payload, strict_map_key=False)
    m.pop(integrity.DIGEST_KEY, None)
    paths = list(_paths(m))
    path = paths[int(rng.integers(len(paths)))]
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = _junk(rng)
    try:
        return integrity.seal(m, _pack)  # a valid digest: what the attacker's encoder does
    except (OverflowError, ValueError, TypeError):
        return payload


def _label_junk(labels: list, rng: np.random.Generator) -> list:
    """The label names with one mutation."""
    labels = list(labels)
    i = int(rng.integers(len(labels))) if labels else 0
    choice = int(rng.integers(8))
    if choice == 0 and labels:
        labels[i] = "x" * (MAX_LABEL_CHARS + int(rng.integers(1, 5000)))
    elif choice == 1 and labels:
        labels[i] = ""
    elif choice == 2 and len(labels) > 1:
        labels[i] = labels[i - 1]  # a duplicate
    elif choice == 3 and labels:
        labels[i] = _junk(rng)  # not a string
    elif choice == 4:
        labels = [f"l{k}" for k in range(MAX_LABELS + int(rng.integers(1, 3)))]
    elif choice == 5 and labels:
        labels.pop(i)  # rows and counts no longer match
    elif choice == 6:
        labels.append("é" * MAX_LABEL_CHARS)  # a valid name, one row too few
    else:
        labels = [str(s) + "\x00\u202e" if isinstance(s, str) else s for s in labels]
    return labels


def _table_mutation(payload: bytes, rng: np.random.Generator) -> bytes:
    """One mutation of the prototype library of an update or a global (the payload as it is
    when it carries none)."""
    m = msgpack.unpackb(payload, strict_map_key=False)
    table = m.get("prototypes")
    if not isinstance(table, dict) or set(table) != {"labels", "rows", "counts"}:
        return payload
    m.pop(integrity.DIGEST_KEY, None)
    n = len(table["labels"])
    width = int(table["rows"]["shape"][1])
    part = int(rng.integers(3))
    if part == 0:
        table["labels"] = _label_junk(table["labels"], rng)
    elif part == 1:
        counts = [np.full(n, -1, np.int64), np.full(n, MAX_COUNT + 1, np.int64),
                  np.full(n, 2**63 - 1, np.int64), np.full(n, 3.0, np.float32),
                  np.ones(n + 1, np.int64), np.full(n, MAX_COUNT, np.int64)]
        table["counts"] = encode_tensor(counts[int(rng.integers(len(counts)))])
    else:
        rows = [np.full((n, width), np.nan, np.float32), np.full((n, width), 1e30, np.float32),
                np.zeros((n, width + 1), np.float32), np.zeros((n, width), np.float64),
                np.zeros((n + 1, width), np.float32), np.zeros(n * width, np.float32)]
        table["rows"] = encode_tensor(rows[int(rng.integers(len(rows)))])
    try:
        return integrity.seal(m, _pack)
    except (OverflowError, ValueError, TypeError):
        return payload


def _byte_mutation(payload: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(payload)
    op = int(rng.integers(4))
    if op == 0:
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
    elif op == 1:
        b = b[: int(rng.integers(len(b)))]
    elif op == 2:
        pos = int(rng.integers(len(b)))
        b[pos:pos] = rng.bytes(int(rng.integers(1, 64)))
    else:
        b += rng.bytes(int(rng.integers(1, 64)))
    return bytes(b)


def library(width: int, labels: tuple[str, ...] = ("cat", "dog"), seed: int = 0
            ) -> LabelRows:
    """A valid prototype library of `labels` with rows of `width`."""
    rng = np.random.default_rng(seed)
    return LabelRows(labels, rng.normal(size=(len(labels), width)).astype(np.float32),
                     np.full(len(labels), 4, np.int64))


def table_attacks(tensors: dict[str, np.ndarray], width: int) -> list[bytes]:
    """Fixed updates whose prototype library is hostile (each from a fresh sequence number,
    so that admission lets it reach the library checks)."""
    good = library(width)
    hostile = [
        LabelRows(tuple(f"l{k}" for k in range(MAX_LABELS)),
                  np.zeros((MAX_LABELS, width), np.float32),
                  np.full(MAX_LABELS, MAX_COUNT, np.int64)),  # valid, at every bound
        LabelRows(("cat",), good.rows[:1], np.array([MAX_COUNT], np.int64)),  # repeated:
        LabelRows(("cat",), good.rows[:1], np.array([MAX_COUNT], np.int64)),  # saturates
        LabelRows(("x" * MAX_LABEL_CHARS,), np.full((1, width), 1e30, np.float32),
                  np.ones(1, np.int64)),
        LabelRows(good.labels, np.zeros((2, width + 1), np.float32), good.counts),
        LabelRows(good.labels, good.rows, np.array([-1, 2**63 - 1], np.int64)),
        LabelRows(good.labels, good.rows, np.array([MAX_COUNT + 1, 1], np.int64)),
    ]
    return [encode(Update(CLIENTS[i % len(CLIENTS)], 0, 100 + i, 0, 100 + i, 8, tensors,
                          class_counts={0: 8}, prototypes=t), fleet=FLEET)
            for i, t in enumerate(hostile)]


def attacks(tensors: dict[str, np.ndarray]) -> list[bytes]:
    """The fixed attack payloads of the trust-boundary issue."""
    inner: Any = {"state": "online"}
    for _ in range(500):
        inner = {"x": inner}
    bomb = _pack({"schema": 1, "kind": "status", "fleet": FLEET, "sender": "d0", "x": inner})
    zero = {f"t{i}": np.zeros(0, np.float32) for i in range(100_000)}
    big = {k: np.full(v.shape, 1e30, np.float32) for k, v in tensors.items()}
    return [
        bomb,
        encode(Update("d0", 0, 1, 0, 1, 1, zero), fleet=FLEET),
        encode(Message("control", {"command": "stop"}, sender="d0"), fleet=FLEET),
        encode(Update("d0", 0, 1, 0, 1, 10**12, tensors), fleet=FLEET),
        encode(Update("d0", 0, 2**64 - 1, 0, 1, 1, tensors), fleet=FLEET),
        encode(Update("d0", 10**9, 1, 0, 1, 1, tensors), fleet=FLEET),
        encode(Update("d0", 0, 1, 0, 1, 5, tensors, class_counts={0: 0}), fleet=FLEET),
        encode(Update("d0", 0, 1, 0, 1, 1000,
                      tensors, class_counts={i: 1 for i in range(1000)}), fleet=FLEET),
        encode(Update("d0", 0, 1, 0, 1, 1, big), fleet=FLEET),
    ]


def payloads(corpus: list[bytes], extra: list[bytes], n: int, seed: int = 0) -> Iterator[bytes]:
    """`n` payloads: every fixed attack once, then byte and field mutations of the corpus."""
    rng = np.random.default_rng(seed)
    yield from extra[:n]
    for _ in range(max(0, n - len(extra))):
        base = corpus[int(rng.integers(len(corpus)))]
        r = rng.random()
        if r < 0.4:
            yield _byte_mutation(base, rng)
        elif r < 0.75:
            yield _field_mutation(base, rng)
        elif r < 0.95:
            yield _table_mutation(base, rng)
        else:
            yield base


def _rss_mib() -> float:
    """Resident memory of this process now (Linux), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def traced_share(n: int) -> int:
    """Payloads of a run of `n` traced by tracemalloc (the rest are timed without it): 10^4,
    and never more than a tenth of the run."""
    return min(10_000, n // 10)


def drive(handle: Callable[[str, bytes], None], counters: Callable[[], dict[str, int]],
          topics: list[str], stream: Iterator[bytes], seed: int = 0,
          progress: bool = False, traced: int = 10_000) -> dict:
    """Feed `stream` to `handle` on random `topics`: time per payload, escaped exceptions,
    the process's peak resident memory over its start, and (for the first `traced`
    payloads, timed separately) the peak of Python allocations by tracemalloc."""
    rng = np.random.default_rng(seed + 1)
    escaped: Counter[str] = Counter()
    slowest = (0.0, b"", "")
    top: list[tuple[float, bytes, str]] = []  # the 10 slowest, re-timed at the end
    n = 0
    times: list[float] = []
    cpu_times: list[float] = []  # this thread's CPU time: what a stall of the machine leaves out
    gc_times: list[float] = []  # of which in Python's cyclic garbage collector
    gc_now = [0.0, 0.0]  # [collection start, total this payload]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_now[0] = time.perf_counter()
        else:
            gc_now[1] += time.perf_counter() - gc_now[0]

    gc.callbacks.append(on_gc)
    freeze_startup_heap()  # as the daemons do once they have started
    rss0 = _rss_mib()
    peak_rss = rss0
    tracemalloc.start()
    base_mem = tracemalloc.get_traced_memory()[0]
    t_all = time.perf_counter()
    for payload in stream:
        if n == traced:
            peak_py = tracemalloc.get_traced_memory()[1] - base_mem
            tracemalloc.stop()
        topic = topics[int(rng.integers(len(topics)))]
        gc_now[1] = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            handle(topic, payload)
        except Exception as e:  # noqa: BLE001  (what the bench exists to find)
            escaped[f"{type(e).__name__}: {str(e)[:80]}"] += 1
        dt = time.perf_counter() - t0
        if n >= traced:  # timings without tracemalloc's overhead
            times.append(dt)
            cpu_times.append(time.thread_time() - c0)
            gc_times.append(gc_now[1])
            if dt > slowest[0]:
                slowest = (dt, payload, topic)
            if len(top) < 10 or dt > top[-1][0]:
                top = sorted([*top, (dt, payload, topic)], key=lambda x: -x[0])[:10]
        n += 1
        if n % 1000 == 0:
            peak_rss = max(peak_rss, _rss_mib())
        if progress and n % 10_000 == 0:
            print(f"  {n} payloads, {sum(escaped.values())} escaped, slowest "
                  f"{slowest[0] * 1e3:.1f} ms", flush=True)
    wall = time.perf_counter() - t_all
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    if tracemalloc.is_tracing():
        peak_py = tracemalloc.get_traced_memory()[1] - base_mem
        tracemalloc.stop()
    # a machine shared with other jobs stalls a process now and then: time the 10 slowest
    # payloads again (best of 3) to tell their own cost from such stalls
    retimed = []
    for _, payload, topic in top:
        best = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # counted in the main pass
                handle(topic, payload)
            best = min(best, time.perf_counter() - t0)
        retimed.append(best * 1e3)
    c = counters()
    internal = int(c.get("internal", 0)) + int(c.get("rejected_internal", 0))
    t = np.array(times or [0.0]) * 1e3
    cpu = np.array(cpu_times or [0.0]) * 1e3
    own = cpu - np.array(gc_times or [0.0]) * 1e3  # CPU time less the collector's
    return {"payloads": n, "escaped": sum(escaped.values()) + internal,
            "escaped_kinds": dict(escaped.most_common(10)), "internal_errors": internal,
            "timed_payloads": len(times), "slowest_ms": round(float(t.max()), 2),
            "p99_ms": round(float(np.percentile(t, 99)), 3),
            "over_100ms": int((t > 100).sum()),
            "slowest_cpu_ms": round(float(cpu.max()), 2),
            "over_100ms_cpu": int((cpu > 100).sum()),
            "over_100ms_cpu_without_gc": int((own > 100).sum()),
            "slowest_cpu_without_gc_ms": round(float(own.max()), 2),
            "gc_ms_max": round(float(np.max(gc_times or [0.0])) * 1e3, 2),
            "slowest10_ms": [round(x[0] * 1e3, 1) for x in top],
            "slowest10_retimed_ms": [round(x, 1) for x in retimed],
            "slowest_payload_bytes": len(slowest[1]), "slowest_payload_head": slowest[1][:48].hex(),
            "slowest_topic": slowest[2], "peak_python_mib": round(peak_py / 2**20, 2),
            "traced_payloads": min(n, traced), "rss_start_mib": round(rss0, 1),
            "rss_peak_growth_mib": round(peak_rss - rss0, 1),
            "wall_s": round(wall, 1), "per_payload_ms": round(wall / max(n, 1) * 1e3, 3),
            "rejections": dict(sorted(c.items()))}


def _model(size: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"fc.weight": rng.normal(size=(size, size)).astype(np.float32),
            "fc.bias": np.zeros(size, np.float32), "bn.running_var": np.ones(size, np.float32)}


def fuzz_aggregator(n: int, state_dir: Path, seed: int = 0, progress: bool = False) -> dict:
    """`n` payloads through `AggregatorDaemon.handle` (async rounds, robust rules on, head
    prototypes: the updates carry prototype libraries)."""
    from edgefcl.federation.heads import library_width
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon

    cfg = apply(RunConfig(), {"quiet": True, "mqtt": {"fleet": FLEET, "max_payload": 4 << 20},
                              "learn": {"head": "prototypes"},
                              "fed": {"clients": 3, "mode": "async", "min_clients": 2,
                                      "burn_in": 0, "jump": 1, "round_timeout": 0.0,
                                      "max_staleness": 10**6}})
    tensors = _model()
    d = AggregatorDaemon(cfg, tensors, state_dir, fresh=True)
    d.link = NullLink()
    tp = d.topics
    width = library_width(cfg, tensors)
    corpus = [encode(Update(c, 0, s, 0, s, 8, tensors, class_counts={0: 8},
                            prototypes=library(width, ("cat", f"{c}-{s}"), seed=s)), fleet=FLEET)
              for c in CLIENTS for s in (1, 2)]
    corpus += [encode(Tick("d0", 3, 0, 3), fleet=FLEET),
               encode(Message("status", {"state": "online"}, sender="d1"), fleet=FLEET),
               encode(Message("control", {"command": "pause"}, sender="op"), fleet=FLEET)]
    topics = [tp.update(c) for c in CLIENTS] + [tp.status("d1"), tp.control,
                                                f"{tp.base}/update/x/y", f"{tp.base}/global"]

    def handle(topic: str, payload: bytes) -> None:
        # sequence numbers are forgotten before every payload, so that a mutated copy of a
        # corpus update reaches the checks behind admission (encoding, prototype library,
        # robust rules) instead of stopping as a duplicate
        d.agg.admission.last_seq.clear()
        d.agg.admission.last_batch.clear()
        d.handle(topic, payload)
        d._close_safely(lambda: d.agg.poll(time.monotonic()))
        d.stop_event.clear()  # a genuine stop on the control topic: keep fuzzing

    report = drive(handle, lambda: dict(d.agg.counters), topics,
                   payloads(corpus, attacks(tensors) + table_attacks(tensors, width), n, seed),
                   seed, progress, traced=traced_share(n))
    report["rounds"] = d.agg.rounds
    lib = d.agg.global_.prototypes  # what every device must still accept
    report["library_labels"] = len(lib.labels)
    report["library_valid"] = check_rows(lib, width) is None and bool(
        lib.rows.size == 0 or np.abs(lib.rows).max() <= 1e6)
    report["global_finite"] = bool(all(np.isfinite(t).all()
                                       for t in d.agg.global_.tensors.values()))
    report["global_max_abs"] = float(max(np.abs(t).max() for t in d.agg.global_.tensors.values()))
    d.store.close()
    return report


def fuzz_device(n: int, seed: int = 0, progress: bool = False) -> dict:
    """`n` payloads through a device's message handler (`DeviceRunner._on_message`); the
    device runs head prototypes, the globals carry libraries, and every global it adopts is
    merged into its client as its training loop would (a global that passed the checks but
    cannot be merged escapes)."""
    from edgefcl.build import make_client, prepare
    from edgefcl.learn.global_format import global_tensors
    from edgefcl.runtime.device_runner import DeviceRunner

    cfg = apply(RunConfig(), {"quiet": True, "mqtt": {"fleet": FLEET},
                              "data": {"tasks": 2, "classes_per_task": 2},
                              "learn": {"model": "mlp", "hidden": 64, "head": "prototypes"},
                              "fed": {"downlink": "dense"}})
    setup = prepare(cfg, 0)
    client = make_client(cfg, setup, 0, "fedavg", 0)
    r = DeviceRunner(cfg, client)
    r.link = NullLink()
    tp = r.topics
    good = global_tensors(client.model, cfg.fed.encoding)
    width = client.protos.library.dim + 1
    corpus = [encode(GlobalModel(v, good, ("c0",), library(width, ("0", "1", f"new{v}"), v)),
                     fleet=FLEET) for v in (1, 2)]
    x = np.zeros((4, *setup.dataset.sample_shape), np.float32)
    corpus += [encode_batch(Batch(x, np.array(["0", "1", "cat", "1"]), 0, 1, False),
                            client=client.cid, fleet=FLEET),  # a stream batch with label names
               encode(Message("answer", {"tick": 1, "version": 1, "participants": ["c0"]},
                              sender="aggregator"), fleet=FLEET),
               encode(Message("control", {"command": "pause"}, sender="op"), fleet=FLEET)]
    extra = [encode(GlobalModel(2**63 - 1, good, ()), fleet=FLEET),
             encode(GlobalModel(3, good, (), library(width + 1)), fleet=FLEET),  # other width
             encode(GlobalModel(3, good, (), library(width - 1)), fleet=FLEET),
             encode(GlobalModel(1, {**good, "x": np.zeros(1, np.float32)}, ()), fleet=FLEET),
             encode(Message("control", {"command": "stop"}, sender="d0"), fleet=FLEET)]
    topics = [tp.global_, tp.global_, tp.tick, tp.control, tp.stream(client.cid)]

    def handle(topic: str, payload: bytes) -> None:
        before = r.latest
        r._on_message(topic, payload)
        if r.latest is not before and r.latest.version > client.version:
            client.apply_global(r.latest)  # what the training loop does with it
        r.stop.clear()
        r.paused = False
        while not r.batches.empty():  # what the training loop consumes
            r.batches.get_nowait()

    report = drive(handle, lambda: dict(r.rejections), topics,
                   payloads(corpus, extra, n, seed), seed, progress, traced=traced_share(n))
    report["adopted_version"] = None if r.latest is None else r.latest.version
    return report


def bench_fuzz(cfg: RunConfig, out: Path, count: int) -> dict:
    """`edgefcl bench fuzz`: `count` payloads (default 10^5) through each handler."""
    n = count or 100_000
    report = {}
    logging.getLogger("edgefcl").setLevel(logging.CRITICAL)  # one line per rejection: too many
    for name, run in (("aggregator", lambda: fuzz_aggregator(n, out / "fuzz_state",
                                                             progress=True)),
                      ("device", lambda: fuzz_device(n, progress=True))):
        print(f"{name}: {n} mutated payloads", flush=True)
        r = run()
        report[name] = r
        print(f"{name}: {r['escaped']} escaped exceptions; slowest {r['slowest_ms']} ms "
              f"({r['slowest_payload_bytes']} bytes on {r['slowest_topic']}), p99 "
              f"{r['p99_ms']} ms, {r['over_100ms']} over 100 ms (of {r['timed_payloads']} "
              f"timed; {r['over_100ms_cpu']} over 100 ms of CPU time, slowest "
              f"{r['slowest_cpu_ms']} ms of CPU, {r['slowest_cpu_without_gc_ms']} ms without the "
              f"garbage collector, whose longest pause was {r['gc_ms_max']} ms; the 10 "
              f"slowest re-timed, best of 3: max "
              f"{max(r['slowest10_retimed_ms'] or [0])} ms); peak Python allocations "
              f"{r['peak_python_mib']} MiB (first "
              f"{r['traced_payloads']}), resident memory +{r['rss_peak_growth_mib']} MiB over "
              f"{r['rss_start_mib']} MiB; {r['per_payload_ms']} ms/payload")
        print("  rejections: " + json.dumps(r["rejections"]))
    return report
