"""The aggregator's state directory: one transaction per round, refused when foreign, finished
or damaged, and consistent after SIGKILLs at random moments."""

from __future__ import annotations

import os
import sqlite3

import numpy as np
import pytest

from edgefcl.bench import crash as bench_crash
from edgefcl.federation.label_rows import LabelRows
from edgefcl.runtime.store import (
    DB_NAME,
    StateError,
    StateStore,
    global_digest,
    tensors_digest,
    tensors_to_bytes,
)
from edgefcl.transport.codec import tensor_spec

T = {"w": np.ones((2, 3), np.float32)}
SPEC = tensor_spec(T)
CRASH_LIBRARY = LabelRows.empty(65)  # bench_crash runs head prototypes (rows of width 65)


def fresh_store(tmp_path, **kw) -> StateStore:
    return StateStore.open(tmp_path / "st", fleet="f", spec=SPEC, **kw)


def save_round(store, version, tensors, rnd=None):
    line = None if rnd is None else {"round": rnd, "version": version}
    store.commit({"version": version, "rounds": rnd or 0}, tensors, line)


def test_round_trip_and_views(tmp_path) -> None:
    s = fresh_store(tmp_path)
    save_round(s, 0, T)
    save_round(s, 1, {"w": T["w"] * 2}, rnd=1)
    s.write_views({"version": 1, "rounds": 1}, T, rewrite=True)
    state, tensors, library = s.load(SPEC)
    assert state["version"] == 1 and (tensors["w"] == 2).all() and library is None
    assert (tmp_path / "st" / "rounds.jsonl").read_text().count("\n") == 1
    s.close()


def test_a_version_is_never_saved_with_other_tensors(tmp_path) -> None:
    s = fresh_store(tmp_path)
    save_round(s, 0, T)
    with pytest.raises(StateError, match="other tensors"):
        save_round(s, 0, {"w": T["w"] * 3})
    save_round(s, 0, T)  # the same tensors again are fine
    assert s.published(0) == tensors_digest(T)


def test_foreign_and_finished_states_are_refused_with_what_to_do(tmp_path) -> None:
    s = fresh_store(tmp_path)
    save_round(s, 0, T)
    s.mark_finished()
    s.close()
    assert "start a new one with --fresh" in StateStore.finished_run(tmp_path / "st")
    with pytest.raises(StateError, match="--resume"):
        fresh_store(tmp_path)
    fresh_store(tmp_path, resume=True).close()
    assert StateStore.finished_run(tmp_path / "st") is None  # resumed: open again
    assert StateStore.finished_run(tmp_path / "none") is None
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / DB_NAME).write_bytes(b"not sqlite")
    assert StateStore.finished_run(tmp_path / "junk") is None  # open() says what is wrong
    with pytest.raises(StateError, match="fleet.*--fresh"):
        StateStore.open(tmp_path / "st", fleet="other", spec=SPEC)
    other_spec = tensor_spec({"w": np.ones(4, np.float32)})
    with pytest.raises(StateError, match="spec_hash.*--fresh"):
        StateStore.open(tmp_path / "st", fleet="f", spec=other_spec)
    s = StateStore.open(tmp_path / "st", fleet="other", spec=other_spec, fresh=True)
    assert s.load(other_spec) is None  # started over
    s.close()


def test_damaged_states_are_refused(tmp_path) -> None:
    s = fresh_store(tmp_path)
    save_round(s, 0, T)
    bad = {"w": np.full((2, 3), np.nan, np.float32)}
    s.conn.execute("UPDATE globals SET tensors = ?, sha256 = ? WHERE version = 0",
                   (tensors_to_bytes(bad), tensors_digest(bad)))
    with pytest.raises(StateError, match="NaN"):
        s.load(SPEC)
    s.conn.execute("UPDATE globals SET tensors = ? WHERE version = 0", (tensors_to_bytes(T),))
    with pytest.raises(StateError, match="sha256"):
        s.load(SPEC)
    s.conn.execute("UPDATE globals SET sha256 = ? WHERE version = 0", (tensors_digest(T),))
    s.conn.execute("UPDATE state SET json = '{\"version\": 3, \"rounds\": 0}'")
    with pytest.raises(StateError, match="version 3"):
        s.load(SPEC)
    s.conn.execute("UPDATE state SET json = 'not json'")
    with pytest.raises(StateError, match="unreadable"):
        s.load(SPEC)
    s.close()
    (tmp_path / "st" / "state.db").write_bytes(b"garbage" * 100)
    for extra in ("state.db-wal", "state.db-shm"):
        (tmp_path / "st" / extra).unlink(missing_ok=True)
    with pytest.raises(StateError, match="--fresh"):
        fresh_store(tmp_path)


def test_a_legacy_state_without_the_database_is_refused(tmp_path) -> None:
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "state.json").write_text("{}")
    with pytest.raises(StateError, match="--fresh"):
        fresh_store(tmp_path)


def test_the_crash_check_detects_republished_versions_and_double_counts(tmp_path) -> None:
    d = tmp_path / "state"
    s = StateStore.open(d, fleet="crash", spec=tensor_spec(bench_crash.INITIAL))
    s.commit({"version": 0, "rounds": 0}, bench_crash.INITIAL, prototypes=CRASH_LIBRARY)
    one = {k: v + 1 for k, v in bench_crash.INITIAL.items()}
    s.commit({"version": 1, "rounds": 1}, one,
             {"round": 1, "version": 1, "seqs": {"d0": 1, "d1": 1}}, CRASH_LIBRARY)
    s.close()
    log = d / "published.log"
    log.write_bytes(bench_crash._record(0, global_digest(bench_crash.INITIAL, CRASH_LIBRARY)))
    assert bench_crash.check(d)["version"] == 1
    with open(log, "ab") as f:  # v1 published with v0's tensors
        f.write(bench_crash._record(1, global_digest(bench_crash.INITIAL, CRASH_LIBRARY)))
    with pytest.raises(AssertionError, match="version 1 published as .* but saved as"):
        bench_crash.check(d)
    # published, never saved
    log.write_bytes(bench_crash._record(2, global_digest(one, CRASH_LIBRARY)))
    with pytest.raises(AssertionError, match="version 2 published as .* but saved never"):
        bench_crash.check(d)
    (d / "published.log").write_text("")
    conn = sqlite3.connect(d / "state.db")
    conn.execute("INSERT INTO rounds VALUES (2, ?)",
                 ('{"round": 2, "version": 2, "seqs": {"d0": 1}}',))
    conn.execute("""UPDATE state SET json = '{"version": 1, "rounds": 2}'""")
    conn.commit()
    conn.close()
    with pytest.raises(AssertionError, match="counted twice"):
        bench_crash.check(d)


@pytest.mark.slow
def test_state_stays_consistent_across_random_sigkills(tmp_path) -> None:
    report = bench_crash.run(20, tmp_path, seed=1, progress=False)
    assert report["failures"] == [] and report["final"]["rounds"] > 20


def test_cli_refuses_a_finished_state_in_one_line(tmp_path) -> None:
    import subprocess
    import sys

    from edgefcl.support.statefiles import save_tensors

    save_tensors(tmp_path / "init.npz", T)
    s = StateStore.open(tmp_path / "st", fleet="f", spec=SPEC)
    save_round(s, 0, T)
    s.mark_finished()
    s.close()
    cmd = [sys.executable, "-m", "edgefcl", "aggregator", "--broker", "mqtt://127.0.0.1:9",
           "--fleet", "f", "--initial", str(tmp_path / "init.npz"), "--state-dir",
           str(tmp_path / "st"), "--connect-timeout", "1", "-q"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--resume" in p.stderr and "--fresh" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # -q: the error line alone


def test_the_crash_check_skips_publish_records_cut_by_a_kill(tmp_path) -> None:
    """A record the kill cut (inside the digest, or inside the version number, later run into
    by the next child's record) is skipped and counted, never read as another version."""
    d = tmp_path / "state"
    s = StateStore.open(d, fleet="crash", spec=tensor_spec(bench_crash.INITIAL))
    s.commit({"version": 0, "rounds": 0}, bench_crash.INITIAL, prototypes=CRASH_LIBRARY)
    s.close()
    whole = bench_crash._record(0, global_digest(bench_crash.INITIAL, CRASH_LIBRARY))
    log = d / "published.log"
    log.write_bytes(whole + whole[:30])  # the last record cut inside the digest
    assert bench_crash.check(d)["torn_records"] == 1
    log.write_bytes(whole + b"8")  # cut after one digit of "830 ..."
    link = bench_crash._PublishLog(log)  # the next child closes the cut line before it appends
    os.write(link.fd, whole)
    os.close(link.fd)
    assert log.read_bytes() == whole + b"8\n" + whole
    assert bench_crash.check(d) == {"version": 0, "rounds": 0, "published": 1,
                                    "torn_records": 1}


LIB = LabelRows(("cat", "dög"), np.arange(8, dtype=np.float32).reshape(2, 4),
                np.array([3, 5], np.int64))


def test_the_library_is_saved_with_its_global_under_one_sha256(tmp_path) -> None:
    s = fresh_store(tmp_path)
    s.commit({"version": 0, "rounds": 0}, T, prototypes=LIB)
    state, tensors, library = s.load(SPEC, library_width=4)
    assert set(tensors) == {"w"} and library.labels == LIB.labels
    assert (library.rows == LIB.rows).all() and (library.counts == LIB.counts).all()
    assert s.published(0) == global_digest(T, LIB) != tensors_digest(T)
    other = LabelRows(LIB.labels, LIB.rows + 1, LIB.counts)
    with pytest.raises(StateError, match="other tensors"):  # same tensors, another library
        s.commit({"version": 0, "rounds": 0}, T, prototypes=other)
    with pytest.raises(StateError, match="head is fixed"):
        s.load(SPEC)
    with pytest.raises(StateError, match="width 4, the model 9"):
        s.load(SPEC, library_width=9)
    s.close()


def test_a_damaged_library_is_refused(tmp_path) -> None:
    from edgefcl.federation.label_rows import rows_arrays

    s = fresh_store(tmp_path)
    s.commit({"version": 0, "rounds": 0}, T)
    with pytest.raises(StateError, match="head is prototypes"):
        s.load(SPEC, library_width=4)
    for bad in ({"prototypes::rows": LIB.rows},  # partial
                rows_arrays(LabelRows(("a", "a"), LIB.rows, LIB.counts)),  # duplicate
                rows_arrays(LIB) | {"prototypes::labels": np.frombuffer(b"[1, 2]", np.uint8)},
                rows_arrays(LabelRows(LIB.labels, LIB.rows * np.nan, LIB.counts))):
        blob = T | bad
        s.conn.execute("UPDATE globals SET tensors = ?, sha256 = ? WHERE version = 0",
                       (tensors_to_bytes(blob), tensors_digest(blob)))
        with pytest.raises(StateError, match="prototype|nonfinite"):
            s.load(SPEC, library_width=4)
    s.close()


def test_a_restarted_aggregator_keeps_the_prototype_library(tmp_path) -> None:
    """The real daemon message path and store: a round with prototype rows, a restart on the
    same state directory, the same library (and version digest) afterwards; global.npz and
    the next round's library build on it."""
    from edgefcl.federation.messages import Update
    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
    from edgefcl.transport.codec import encode

    cfg = bench_crash._config()
    state_dir = tmp_path / "state"

    def daemon() -> AggregatorDaemon:
        d = AggregatorDaemon(cfg, bench_crash.INITIAL, state_dir)
        d.link = bench_crash._PublishLog(state_dir / "published.log")
        return d

    def send(d, client, seq, labels):
        rows = np.full((len(labels), 65), seq, np.float32)
        table = LabelRows(labels, rows, np.full(len(labels), 4))
        tensors = {k: np.full(v.shape, seq, np.float32) for k, v in bench_crash.INITIAL.items()}
        d.handle(d.topics.update(client), encode(
            Update(client, d.agg.global_.version, seq, 0, seq, 8, tensors, class_counts={0: 8},
                   prototypes=table), fleet=cfg.mqtt.fleet))

    d = daemon()
    send(d, "d0", 1, ("cat", "owl"))
    send(d, "d1", 1, ("dog",))
    assert d.agg.rounds == 1 and d.agg.global_.prototypes.labels == ("cat", "dog", "owl")
    before = d.agg.global_
    d.store.close()
    again = daemon()
    lib = again.agg.global_.prototypes
    assert again.agg.global_.version == 1 and lib.labels == before.prototypes.labels
    assert (lib.rows == before.prototypes.rows).all()
    assert (lib.counts == before.prototypes.counts).all()
    assert again.store.published(1) == global_digest(before.tensors, before.prototypes)
    saved = np.load(state_dir / "global.npz")
    assert (saved["prototypes::rows"] == before.prototypes.rows).all()
    send(again, "d2", 1, ("yak",))
    send(again, "d3", 1, ("cat",))
    assert again.agg.global_.prototypes.labels == ("cat", "dog", "owl", "yak")
    assert bench_crash.check(state_dir)["version"] == 2
    # the fleet's results.json and model.npz (what `edgefcl export` reads) carry the library
    import json

    from edgefcl.learn.params import global_sha256
    from edgefcl.runtime.fleet_results import FleetResults

    profile = {"model": "mlp", "sample_shape": [64], "n_classes": 2}
    FleetResults(cfg, state_dir, profile, labels=["0", "1"]).write({}, again)
    res = json.loads((state_dir / "results.json").read_text())
    g = again.agg.global_
    assert res["labels"] == list(g.prototypes.labels)
    assert res["global_sha256"] == global_sha256(g.tensors, g.prototypes)
    assert res["global_sha256"] != global_sha256(g.tensors)
    assert (np.load(state_dir / "model.npz")["prototypes::rows"] == g.prototypes.rows).all()
    again.store.close()


def test_a_gaussian_library_is_saved_with_its_sigmas_under_one_sha256(tmp_path) -> None:
    glib = LabelRows(LIB.labels, LIB.rows, LIB.counts, np.full((2, 4), 0.5, np.float32))
    s = fresh_store(tmp_path)
    s.commit({"version": 0, "rounds": 0}, T, prototypes=glib)
    state, tensors, library = s.load(SPEC, library_width=4, library_gaussian=True)
    assert (library.sigmas == glib.sigmas).all()
    assert s.published(0) == global_digest(T, glib) != global_digest(T, LIB)
    other = LabelRows(LIB.labels, LIB.rows, LIB.counts, 2 * glib.sigmas)
    with pytest.raises(StateError, match="other tensors"):  # same rows, other sigmas
        s.commit({"version": 0, "rounds": 0}, T, prototypes=other)
    with pytest.raises(StateError, match="Gaussian rows, this run point rows"):
        s.load(SPEC, library_width=4)
    s.close()
