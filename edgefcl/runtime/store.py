"""The aggregator's state directory: one SQLite transaction per round, validated on load.

`state.db` (sqlite3 from the standard library, WAL journal, synchronous FULL) holds

- `meta`: the fleet run the directory belongs to (fleet, model spec hash, run id, finished);
- `globals`: version -> tensors (npz bytes) and their sha256; with a prototype library (head
  `prototypes`) the library's arrays (`federation.prototypes.rows_arrays`) are saved in the
  same npz and covered by the same sha256, so a version is never published with two libraries;
  the last `keep` versions keep their tensors, older ones only the hash (a version is never
  re-used with other tensors);
- `rounds`: one line per closed round (what `rounds.jsonl` shows);
- `state`: the aggregator's counters, roster and sequence numbers as JSON.

A round's global, its line and the state that counted its updates are written in ONE
transaction, so a crash at any moment leaves either the round or nothing: a restarted
aggregator never republishes a version with other tensors and never counts an update twice.
`state.json`, `global.npz` and `rounds.jsonl` are written after each commit as read-only views
for tools; they are never read back.

`StateStore.open` refuses a directory that belongs to another fleet or model, a finished run
(unless `resume`), or a state that does not validate (non-finite tensors, a hash or version
mismatch) with a `StateError` whose one-line message says what to do (`--fresh` starts over).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import ConfigError
from edgefcl.federation.label_rows import LabelRows, rows_arrays, split_rows
from edgefcl.federation.messages import Tensors
from edgefcl.support.statefiles import atomic_write
from edgefcl.transport.codec import CodecError, TensorSpec, check_tensors, spec_hash, tensor_spec

DB_NAME = "state.db"
FRESH_HINT = "start over with --fresh, or use another --state-dir"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS globals (version INTEGER PRIMARY KEY, sha256 TEXT NOT NULL,
                                    tensors BLOB);
CREATE TABLE IF NOT EXISTS rounds (round INTEGER PRIMARY KEY, line TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS state (id INTEGER PRIMARY KEY CHECK (id = 1), json TEXT NOT NULL);
"""


class StateError(ConfigError):
    """A state directory that cannot be used as it is; the message says what to do (a
    ConfigError, so the CLI shows it as one line with exit code 2)."""


class StateWriteError(RuntimeError):
    """A state that could not be written (a full disk, a read-only mount): the round it
    would have saved is dropped, and the daemon goes on."""


def tensors_to_bytes(tensors: Tensors) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **tensors)
    return buf.getvalue()


def tensors_from_bytes(data: bytes) -> Tensors:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def tensors_digest(tensors: Tensors) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = np.ascontiguousarray(tensors[k])
        h.update(f"{k}|{t.dtype.str}|{t.shape}".encode())
        h.update(t.tobytes())
    return h.hexdigest()


def global_digest(tensors: Tensors, prototypes: LabelRows | None = None) -> str:
    """The sha256 a version is saved under: its tensors and (head prototypes) its library."""
    return tensors_digest(tensors | rows_arrays(prototypes))


def _finished(directory: str | Path, meta: dict[str, str]) -> str:
    return (f"{directory} holds a finished run (run id {meta.get('run_id', '?')}); start a "
            "new one with --fresh, or serve its final model with --resume (its devices are "
            "done: with --exit-when-done it ends at once)")


class StateStore:
    """The state of one fleet run in `directory` (see the module docstring)."""

    def __init__(self, directory: Path, conn: sqlite3.Connection, keep: int) -> None:
        self.directory = directory
        self.conn = conn
        self.keep = keep

    # -- opening --------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: Path, *, fleet: str, spec: TensorSpec, fresh: bool = False,
             resume: bool = False, keep: int = 4) -> StateStore:
        """Open (or create) the state of fleet `fleet` with model `spec`; raises StateError."""
        directory = Path(directory)
        if fresh and directory.exists():
            for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", "state.json",
                         "global.npz", "rounds.jsonl"):
                (directory / name).unlink(missing_ok=True)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o700)  # the fleet's state: its owner's alone
        except OSError as e:
            raise StateError(f"cannot create the state directory {directory}: "
                             f"{e.strerror}") from None
        legacy = (directory / "state.json").exists() and not (directory / DB_NAME).exists()
        if legacy:
            raise StateError(f"{directory} holds a state without {DB_NAME} (an older edgefcl "
                             f"or another tool); {FRESH_HINT}")
        try:  # 0600 like the other state files (SQLite gives its -wal and -shm the same)
            os.close(os.open(directory / DB_NAME, os.O_CREAT | os.O_RDWR, 0o600))
            os.chmod(directory / DB_NAME, 0o600)
            conn = sqlite3.connect(directory / DB_NAME, isolation_level=None, timeout=10,
                                   check_same_thread=False)  # used by one thread at a time
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            raise StateError(f"{directory / DB_NAME} is not a readable state ({e}); "
                             f"{FRESH_HINT}") from None
        except OSError as e:
            raise StateError(f"cannot open {directory / DB_NAME}: {e.strerror}") from None
        store = cls(directory, conn, keep)
        meta = store.meta()
        want = {"fleet": fleet, "spec_hash": spec_hash(spec)}
        if not meta:
            store._write_meta({**want, "run_id": secrets.token_hex(8), "finished": "0",
                               "created": str(round(time.time(), 3))})
        else:
            for key, value in want.items():
                if meta.get(key) != value:
                    conn.close()
                    raise StateError(
                        f"{directory} belongs to another fleet run ({key} {meta.get(key)!r}, "
                        f"this one {value!r}); {FRESH_HINT}")
            if meta.get("finished") == "1" and not resume:
                conn.close()
                raise StateError(_finished(directory, meta))
            if meta.get("finished") == "1":
                store._write_meta({"finished": "0"})
        return store

    @staticmethod
    def finished_run(directory: str | Path) -> str | None:
        """Why `directory` refuses a new run because it holds a finished one (None: it does
        not, or it cannot tell: `open` says what is wrong). Read-only, so that a daemon
        refuses before it builds its model and data."""
        path = Path(directory) / DB_NAME
        if not path.is_file():
            return None
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
            try:
                meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            finally:
                conn.close()
        except sqlite3.DatabaseError:
            return None
        return _finished(directory, meta) if meta.get("finished") == "1" else None

    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())

    def _write_meta(self, values: dict[str, str]) -> None:
        with self._txn():
            self.conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                  list(values.items()))

    def _txn(self):
        conn = self.conn

        class _Txn:
            def __enter__(self_inner):
                conn.execute("BEGIN IMMEDIATE")

            def __exit__(self_inner, exc_type, *_):
                conn.execute("ROLLBACK" if exc_type else "COMMIT")
                return False

        return _Txn()

    # -- loading --------------------------------------------------------------------------
    def load(self, spec: TensorSpec, library_width: int | None = None,
             library_gaussian: bool = False
             ) -> tuple[dict[str, Any], Tensors, LabelRows | None] | None:
        """(state, tensors and prototype library of the current global), validated; None for
        a new run. `library_width`: the row width of the run's library (None: the run has no
        library, and a saved one is refused); `library_gaussian`: whether its rows are
        Gaussian (a saved library of the other kind is refused)."""
        row = self.conn.execute("SELECT json FROM state WHERE id = 1").fetchone()
        if row is None:
            return None
        where = f"{self.directory / DB_NAME}"
        try:
            state = json.loads(row[0])
            version = int(state["version"])
        except (ValueError, KeyError, TypeError):
            raise StateError(f"{where}: the saved state is unreadable; {FRESH_HINT}") from None
        g = self.conn.execute("SELECT version, sha256, tensors FROM globals ORDER BY version "
                              "DESC LIMIT 1").fetchone()
        if g is None or g[0] != version or g[2] is None:
            raise StateError(f"{where}: state version {version} has no saved global "
                             f"(latest {None if g is None else g[0]}); {FRESH_HINT}")
        try:
            tensors = tensors_from_bytes(g[2])
        except Exception:
            raise StateError(f"{where}: the global of version {version} is unreadable; "
                             f"{FRESH_HINT}") from None
        if tensors_digest(tensors) != g[1]:
            raise StateError(f"{where}: the global of version {version} fails its sha256; "
                             f"{FRESH_HINT}")
        try:
            tensors, library = split_rows(tensors)
        except ValueError as e:
            raise StateError(f"{where}: the global of version {version} holds {e}; "
                             f"{FRESH_HINT}") from None
        if (library is None) != (library_width is None):
            has = "no prototype library" if library is None else "a prototype library"
            run = "prototypes" if library is None else "fixed"
            raise StateError(f"{where}: the global of version {version} holds {has} but this "
                             f"run's head is {run}; {FRESH_HINT}")
        if library is not None and library.width != library_width:
            raise StateError(f"{where}: the saved prototype library has rows of width "
                             f"{library.width}, the model {library_width}; {FRESH_HINT}")
        if library is not None and library.gaussian != library_gaussian:
            kinds = {True: "Gaussian rows", False: "point rows"}
            raise StateError(f"{where}: the saved prototype library has "
                             f"{kinds[library.gaussian]}, this run {kinds[library_gaussian]}; "
                             f"{FRESH_HINT}")
        if not all(np.isfinite(t).all() for t in tensors.values() if t.dtype.kind == "f"):
            raise StateError(f"{where}: the global of version {version} holds NaN or Inf; "
                             f"{FRESH_HINT}")
        try:
            check_tensors(tensors, spec)
        except CodecError as e:
            raise StateError(f"{where}: the saved global does not fit the model ({e}); "
                             f"{FRESH_HINT}") from None
        rounds = self.conn.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
        if int(state.get("rounds", 0)) != rounds:
            raise StateError(f"{where}: {rounds} round lines but the state counts "
                             f"{state.get('rounds')}; {FRESH_HINT}")
        return state, tensors, library

    def published(self, version: int) -> str | None:
        """The sha256 recorded for `version`, if it was ever saved."""
        row = self.conn.execute("SELECT sha256 FROM globals WHERE version = ?",
                                (version,)).fetchone()
        return None if row is None else row[0]

    def round_lines(self) -> list[dict]:
        return [json.loads(r[0]) for r in
                self.conn.execute("SELECT line FROM rounds ORDER BY round").fetchall()]

    # -- saving ---------------------------------------------------------------------------
    def commit(self, state: dict[str, Any], tensors: Tensors | None,
               line: dict | None = None, prototypes: LabelRows | None = None) -> None:
        """Save `state`, and with `tensors` the global of `state["version"]` (with its
        prototype library, if any) and its round `line`, in one transaction. Refuses
        (StateError) to store a version again with other tensors or another library."""
        version = int(state["version"])
        if tensors is not None:
            tensors = tensors | rows_arrays(prototypes)
        with self._txn():
            if tensors is not None:
                digest = tensors_digest(tensors)
                old = self.published(version)
                if old is not None and old != digest:
                    raise StateError(f"version {version} was saved with other tensors "
                                     "(or another prototype library)")
                if old is None:
                    self.conn.execute("INSERT INTO globals VALUES (?, ?, ?)",
                                      (version, digest, tensors_to_bytes(tensors)))
                    self.conn.execute("UPDATE globals SET tensors = NULL WHERE version <= ?",
                                      (version - self.keep,))
            if line is not None:
                self.conn.execute("INSERT INTO rounds VALUES (?, ?)",
                                  (int(line["round"]), json.dumps(line)))
            self.conn.execute("INSERT OR REPLACE INTO state VALUES (1, ?)",
                              (json.dumps(state, sort_keys=True),))

    def mark_finished(self) -> None:
        """Record that the run ended (every client done): a restart needs --resume."""
        self._write_meta({"finished": "1"})

    def write_views(self, state: dict[str, Any], tensors: Tensors | None = None,
                    line: dict | None = None, rewrite: bool = False,
                    prototypes: LabelRows | None = None) -> None:
        """state.json, global.npz (with `tensors`, and the library's arrays with `prototypes`)
        and rounds.jsonl (`line` appended, or all lines with `rewrite`) for tools; never read
        back."""
        view = json.dumps(state | {"run": self.meta()}, indent=1, sort_keys=True)
        atomic_write(self.directory / "state.json", view.encode(), fsync=False)
        if tensors is not None:
            atomic_write(self.directory / "global.npz",
                         tensors_to_bytes(tensors | rows_arrays(prototypes)), fsync=False)
        if rewrite:
            lines = "".join(json.dumps(x) + "\n" for x in self.round_lines())
            atomic_write(self.directory / "rounds.jsonl", lines.encode(), fsync=False)
        elif line is not None:
            with open(self.directory / "rounds.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.conn.close()


__all__ = ["StateError", "StateStore", "global_digest", "tensor_spec", "tensors_digest"]
