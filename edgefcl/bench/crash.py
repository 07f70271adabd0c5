"""`edgefcl bench crash`: SIGKILL the aggregator at random moments and check its state.

A child process runs the real `AggregatorDaemon` message path (decode, admission, rounds,
`StateStore` commits) on a stream of deterministic updates from 4 devices that re-send what
the aggregator has not counted yet, as devices do after a crash. Every global it publishes is
logged (version, sha256, crc32 of both) right after the publish. The parent kills the child with
SIGKILL at a random moment (a quarter of the kills while it opens and loads its state, the rest
while it serves, timed from when it is ready so that a slow machine still gets rounds done),
restarts it on the same state directory, and after every kill checks that:

- the state opens and validates (spec hash, finite tensors, versions agree);
- no version was ever published with two different tensors or prototype libraries (publish
  log vs. state: the aggregator runs head `prototypes`, and the updates carry rows of labels
  drawn from a pool, so the library grows and changes with the rounds);
- no update (client, seq) is counted in two rounds;
- the round lines are numbered 1..rounds and their versions increase by one.

The publish log is the drill's own witness and is checked as strictly as the state: a record
counts only when it is whole (a line with its crc32); one cut by the kill is counted as `torn`
and skipped, and a child closes a cut last line before it appends (so that a cut record cannot
run into the next one and name another version).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from edgefcl.config import RunConfig, apply

CLIENTS = ["d0", "d1", "d2", "d3"]
INITIAL = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(64, np.float32)}
LABELS = ("cat", "dog", "owl", "élan", "fox", "yak")
"""The pool the updates' prototype labels are drawn from (the library's row width is 65)."""


def _config() -> RunConfig:
    return apply(RunConfig(), {"quiet": True, "mqtt": {"fleet": "crash"},
                               "learn": {"head": "prototypes"},
                               "fed": {"clients": 4, "mode": "async", "min_clients": 2,
                                       "burn_in": 0, "jump": 1, "round_timeout": 0.0,
                                       "max_staleness": 1000}})


class _PublishLog:
    """The daemon's link on the publishing side: logs every global it publishes, one whole
    line per record (`version sha256 crc32`) in one O_APPEND write, fsync'd."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    os.write(self.fd, b"\n")  # close off a record cut by the last kill

    def publish(self, topic, payload, qos=1, retain=False, wait=False) -> int:
        if topic.endswith("/global"):
            from edgefcl.runtime.store import global_digest
            from edgefcl.transport.codec import decode

            g = decode(payload)
            os.write(self.fd, _record(g.version, global_digest(g.tensors, g.prototypes)))
            os.fsync(self.fd)
        return len(payload)

    def expire_pending(self) -> int:
        return 0


def _record(version: int, sha: str) -> bytes:
    body = f"{version} {sha}"
    return f"{body} {zlib.crc32(body.encode()):08x}\n".encode()


def read_publish_log(path: Path) -> tuple[list[tuple[int, str]], int]:
    """The whole records of the publish log, in order, and how many were cut (torn)."""
    if not path.exists():
        return [], 0
    records: list[tuple[int, str]] = []
    torn = 0
    for raw in path.read_bytes().split(b"\n"):
        if not raw:
            continue
        parts = raw.decode(errors="replace").split(" ")
        body = " ".join(parts[:2])
        if (len(parts) == 3 and parts[0].isdigit() and len(parts[1]) == 64
                and parts[2] == f"{zlib.crc32(body.encode()):08x}"):
            records.append((int(parts[0]), parts[1]))
        else:
            torn += 1
    return records, torn


def child(state_dir: Path) -> None:
    """Serve deterministic updates forever (until killed)."""
    from edgefcl.federation.label_rows import LabelRows
    from edgefcl.federation.messages import Update
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
    from edgefcl.transport.codec import encode

    cfg = _config()
    print("start", flush=True)
    d = AggregatorDaemon(cfg, INITIAL, state_dir)
    d.link = _PublishLog(state_dir / "published.log")
    d._publish_global(d.agg.global_)  # what run() publishes on start
    print("ready", flush=True)
    rng = np.random.default_rng(len(d.agg.last_seq) + d.agg.rounds)
    while True:
        c = CLIENTS[int(rng.integers(len(CLIENTS)))]
        seq = d.agg.last_seq.get(c, 0) + 1
        value = np.random.default_rng(zlib.crc32(f"{c}:{seq}".encode()))
        tensors = {k: value.normal(size=v.shape).astype(np.float32) for k, v in INITIAL.items()}
        labels = tuple(sorted(value.choice(LABELS, size=2, replace=False)))
        table = LabelRows(labels, value.normal(size=(2, 65)).astype(np.float32),
                          value.integers(0, 5, size=2))
        payload = encode(Update(c, d.agg.global_.version, seq, 0, seq, 8, tensors,
                                class_counts={0: 8}, prototypes=table), fleet=cfg.mqtt.fleet)
        d.handle(d.topics.update(c), payload)
        d._close_safely(lambda: d.agg.poll(time.monotonic()))


def check(state_dir: Path) -> dict:
    """Validate the state after a kill; raises AssertionError on any inconsistency."""
    from edgefcl.runtime.store import StateStore
    from edgefcl.transport.codec import tensor_spec

    spec = tensor_spec(INITIAL)
    store = StateStore.open(state_dir, fleet="crash", spec=spec)
    try:
        loaded = store.load(spec, library_width=65)
        lines = store.round_lines()
        seen: dict[int, str] = {}
        records, torn = read_publish_log(state_dir / "published.log")
        latest = None if loaded is None else int(loaded[0]["version"])
        for i, (v, sha) in enumerate(records):
            assert seen.setdefault(v, sha) == sha, (
                f"version {v} published with two models ({seen[v][:12]}, then {sha[:12]})")
            saved = store.published(v)
            assert saved == sha, (
                f"version {v} published as {sha[:12]} but saved "
                f"{'as ' + saved[:12] if saved else 'never'} (saved state at version {latest}; "
                f"record {i + 1} of {len(records)})")
        counted: set[tuple[str, int]] = set()
        for i, line in enumerate(lines, 1):
            assert line["round"] == i and line["version"] == i, f"round line {i}: {line}"
            for c, s in line.get("seqs", {}).items():
                assert (c, s) not in counted, f"update {c} seq {s} counted twice"
                counted.add((c, s))
        version = 0 if loaded is None else int(loaded[0]["version"])
        assert version == len(lines), f"state version {version}, {len(lines)} rounds"
        return {"version": version, "rounds": len(lines), "published": len(seen),
                "torn_records": torn}
    finally:
        store.close()


def run(kills: int, work: Path, seed: int = 0, max_delay: float = 1.2,
        progress: bool = True) -> dict:
    """Kill the child `kills` times at random moments; returns the summary."""
    rng = random.Random(seed)
    state_dir = work / "state"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    failures: list[str] = []
    last: dict = {}
    t0 = time.perf_counter()
    for k in range(kills):
        p = subprocess.Popen([sys.executable, "-m", "edgefcl.bench.crash", str(state_dir)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if rng.random() < 0.25:  # while it opens, validates and loads the state
            p.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # while it serves: from its first publish on
            p.stdout.readline()
            p.stdout.readline()
            time.sleep(rng.uniform(0.0, max_delay))
        p.send_signal(signal.SIGKILL)
        _, err = p.communicate()
        try:
            last = check(state_dir)
        except Exception as e:  # noqa: BLE001  (reported, the drill goes on)
            failures.append(f"kill {k + 1}: {type(e).__name__}: {e}")
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            failures[-1] += f" (child: {tail})"
        if progress:
            print(f"kill {k + 1}/{kills}: version {last.get('version')}, "
                  f"{len(failures)} failures", flush=True)
    return {"kills": kills, "failures": failures, "final": last,
            "wall_s": round(time.perf_counter() - t0, 1)}


def bench_crash(cfg: RunConfig, out: Path, count: int) -> dict:
    """`edgefcl bench crash`: `count` SIGKILLs (default 100)."""
    kills = count or 100
    report = run(kills, out / "crash")
    print(f"\n{kills} SIGKILLs: {len(report['failures'])} inconsistent states; final "
          f"version {report['final'].get('version')}, {report['final'].get('rounds')} rounds, "
          f"{report['final'].get('torn_records', 0)} publish-log records cut by a kill, "
          f"{report['wall_s']} s")
    for f in report["failures"][:10]:
        print("  " + f)
    return report


if __name__ == "__main__":
    child(Path(sys.argv[1]))
