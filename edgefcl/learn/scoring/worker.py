"""A scoring process: the TTA views and their onnxruntime forward passes, off the client's
interpreter.

On a scoring thread, onnxruntime releases the GIL, but building a call's 12 views (numpy
draws, maps, one grid_sample) still holds it 1.2-1.4 ms per training step of the demo, time
the training thread waits. A `ScoreWorker` is a child process (`python -m
edgefcl.learn.scoring.worker THREADS`) that builds the views and runs the scoring snapshot's
session itself: the client's process only sends the candidates and the view seed, and the
graph once per snapshot. The views depend on the seed and the candidates alone, so the
logits are the ones scoring in the client's process gives, bit for bit.

One worker serves every client of a process (`shared_worker`): one request at a time, a session
per client key (the most recent `SESSIONS` kept; a request for an evicted one is answered
"missing" and resent with its graph). It says "ready" once it has imported torch and
onnxruntime (about a second on 2 cores, beside the client's own start); until then a client
scores in its own process (`ready`), with the same seeds and so the same scores, instead of
waiting for the first answer. The worker exits when its stdin closes, so it never
outlives the client's process. Messages are pickles between two processes of the same
installation, framed by an 8-byte length; nothing from a device reaches them.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import logging
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np

log = logging.getLogger(__name__)

SESSIONS = 64
"""Sessions a worker keeps (one per client key, least recently used dropped)."""
REPLY_TIMEOUT = 120.0
"""Seconds a client waits for a reply (the first includes the worker's start-up) before it
counts the worker broken."""
PIPE_BYTES = 1 << 20
"""Pipe buffer asked for (Linux lets an unprivileged process have up to 1 MiB)."""
_HEADER = struct.Struct("<Q")

PerturberSpec = tuple[str, int, float]
"""(kind, views, noise_std) of a built-in perturber: what the worker rebuilds it from."""


class WorkerError(RuntimeError):
    """The scoring worker failed, died or did not answer; score in the client's process."""


def _write(out: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)))
    out.write(data)  # not joined to the header: a graph is 0.4 MB, one more copy
    out.flush()


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from the file descriptor; EOFError at its end, TimeoutError past `deadline`
    (a perf_counter time; None: wait forever)."""
    parts, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.perf_counter()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError(f"no reply in {REPLY_TIMEOUT:.0f} s")
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the pipe closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read(fd: int, deadline: float | None = None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def _widen(pipe: BinaryIO | None) -> None:
    """Give a pipe a buffer of PIPE_BYTES where the system allows (Linux): a snapshot's graph
    (0.4 MB for the demo's CNN) then goes in one write instead of waiting for the worker to
    read each 64 KiB."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if pipe is not None and setsize is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe.fileno(), setsize, PIPE_BYTES)


class ScoreWorker:
    """The client side of a scoring process; thread-safe. Requests are answered in order;
    a client submits one, trains, then takes its reply (`submit`, `result`)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._ids = itertools.count()
        self._known: dict[str, int] = {}  # key -> the snapshot version the worker was sent
        self._requests: dict[int, tuple] = {}  # submitted, unanswered: their arguments
        self._replies: dict[int, tuple] = {}  # read, not yet taken
        self.broken: str | None = None  # why the worker is unusable, once it is
        self._started = False  # the worker said it is ready (its imports are done)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "edgefcl.learn.scoring.worker", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        for pipe in (self._proc.stdin, self._proc.stdout):
            _widen(pipe)

    def ready(self) -> bool:
        """Whether the worker has started (imported what it scores with); never waits. Until
        then a client scores in its own process: the same scores, without waiting up to a
        second for the worker's first answer (the demo's whole score wait)."""
        if self._started or self.broken is not None:
            return self._started
        if not self._read_lock.acquire(blocking=False):
            return False  # a client is reading a reply: asked again at the next call
        try:
            assert self._proc.stdout is not None
            fd = self._proc.stdout.fileno()
            while not self._started and select.select([fd], [], [], 0)[0]:
                self._note(_read(fd, time.perf_counter() + REPLY_TIMEOUT))
        except (OSError, EOFError, TimeoutError, pickle.UnpicklingError, struct.error) as e:
            self._fail(f"the scoring worker stopped answering ({e})")
        finally:
            self._read_lock.release()
        return self._started

    def _note(self, reply: tuple) -> None:
        """Keep a reply read from the worker (under the read lock) until it is taken."""
        if reply[0] == "ready":
            self._started = True
        else:
            self._replies[reply[1]] = reply

    def submit(self, key: str, version: int, graph: bytes, spec: PerturberSpec, method: str,
               x: np.ndarray, seed: int, chunk: int, resend: bool = False) -> int:
        """Ask for the `method` scores of the views of x for the call seed `seed`, from the
        session of `key`'s snapshot `version` (its ONNX `graph`, sent when the worker lacks
        it); the request's id, for `result`."""
        with self._send_lock:
            if self.broken is not None:
                raise WorkerError(self.broken)
            rid = next(self._ids)
            fresh = resend or self._known.get(key) != version
            self._requests[rid] = (key, version, graph, spec, method, x, seed, chunk)
            try:
                assert self._proc.stdin is not None
                _write(self._proc.stdin, ("score", rid, key, graph if fresh else None, spec,
                                          method, x, seed, chunk))
            except OSError as e:
                self._fail(f"the scoring worker stopped answering ({e})")
                raise WorkerError(self.broken) from e
            self._known[key] = version
            return rid

    def result(self, rid: int) -> tuple[np.ndarray, np.ndarray, float]:
        """The (P, N, C) logits, the (N,) scores and the worker's seconds of request `rid`."""
        with self._read_lock:
            while rid not in self._replies:
                if self.broken is not None:
                    raise WorkerError(self.broken)
                try:
                    assert self._proc.stdout is not None
                    reply = _read(self._proc.stdout.fileno(),
                                  time.perf_counter() + REPLY_TIMEOUT)
                except (OSError, EOFError, TimeoutError, pickle.UnpicklingError,
                        struct.error) as e:
                    self._fail(f"the scoring worker stopped answering ({e})")
                    raise WorkerError(self.broken) from e
                self._note(reply)
            reply = self._replies.pop(rid)
        args = self._requests.pop(rid)
        if reply[0] == "missing":  # evicted: send the graph again
            return self.result(self.submit(*args, resend=True))
        if reply[0] != "ok":
            self._known.pop(args[0], None)
            raise WorkerError(f"the scoring worker could not score: {reply[2]}")
        return reply[2], reply[3], reply[4]

    def score(self, *args: Any) -> tuple[np.ndarray, np.ndarray, float]:
        """`submit` and wait for its `result`."""
        return self.result(self.submit(*args))

    def _fail(self, why: str) -> None:
        self.broken = why
        self.close()

    def close(self) -> None:
        """Stop the worker (it also stops on its own when this process exits)."""
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self.broken = self.broken or "the scoring worker was closed"


_SHARED: dict[tuple[int, int], ScoreWorker] = {}
_SHARED_LOCK = threading.Lock()


def shared_worker(threads: int) -> ScoreWorker | None:
    """This process's scoring worker for `threads` CPU threads, started on first use; None
    when no worker process can be started (the caller scores in its own process)."""
    key = (os.getpid(), threads)  # a forked child starts its own
    with _SHARED_LOCK:
        worker = _SHARED.get(key)
        if worker is None or worker.broken is not None:
            try:
                worker = ScoreWorker(threads)
            except OSError as e:
                log.warning("cannot start a scoring worker (%s); scoring stays in this process", e)
                return None
            _SHARED[key] = worker
        return worker


@atexit.register
def _close_shared() -> None:
    """Stop this process's workers as it exits, rather than leaving them to find their pipe
    closed after it (Python warns of a child still running)."""
    with _SHARED_LOCK:
        for (pid, _), worker in _SHARED.items():
            if pid == os.getpid():
                worker.close()


# -- the worker process ----------------------------------------------------------------------
class _Scorer:
    """The worker's state: sessions by client key, perturbers by spec."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.sessions: OrderedDict[str, Any] = OrderedDict()
        self.perturbers: dict[PerturberSpec, Any] = {}

    def score(self, key: str, graph: bytes | None, spec: PerturberSpec, method: str,
              x: np.ndarray, seed: int, chunk: int) -> tuple:
        import torch

        from edgefcl.learn.scoring.perturb import make_perturber
        from edgefcl.learn.scoring.scores import uncertainty
        from edgefcl.ondevice import OnnxModel

        if graph is not None:
            self.sessions[key] = OnnxModel(graph, self.threads)
            while len(self.sessions) > SESSIONS:
                self.sessions.popitem(last=False)
        session = self.sessions.get(key)
        if session is None:
            return ("missing",)
        self.sessions.move_to_end(key)
        perturber = self.perturbers.get(spec)
        if perturber is None:
            perturber = self.perturbers[spec] = make_perturber(spec[0], spec[1], spec[2], 0)
        views = perturber(torch.from_numpy(x), seed)
        z = session.logits(views.flatten(0, 1).numpy(), batch_size=chunk)
        logits = torch.from_numpy(z).reshape(views.shape[0], views.shape[1], -1)
        return ("ok", logits.numpy(), uncertainty(method, logits).numpy())


def serve(threads: int, requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer score requests from `requests` on `replies` until `requests` closes. A thread
    drains `requests` from the start, so that a client's writes do not wait for torch to
    import."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def drain() -> None:
        try:
            while True:
                inbox.put(_read(requests.fileno()))
        except Exception:  # closed (EOFError) or unreadable: stop
            inbox.put(None)

    threading.Thread(target=drain, daemon=True).start()
    import torch

    import edgefcl.learn.scoring.perturb
    import edgefcl.learn.scoring.scores
    import edgefcl.ondevice  # noqa: F401  (imported before `ready`, not at the first request)

    torch.set_num_threads(threads)
    scorer = _Scorer(threads)
    try:
        _write(replies, ("ready", -1))
        while (message := inbox.get()) is not None:
            t0 = time.perf_counter()
            try:
                status, *values = scorer.score(*message[2:])
            except Exception as e:  # one request's failure is the client's to handle
                status, values = "error", [f"{type(e).__name__}: {e}"]
            _write(replies, (status, message[1], *values, time.perf_counter() - t0))
    except OSError:  # the client hung up (it exited before the worker started): stop quietly
        with contextlib.suppress(OSError):
            replies.close()  # drops what could not be written (a later flush would fail)


def main() -> None:
    """The worker's entry point: replies go to the original stdout, anything printed to
    stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the client's; EOF stops us
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
