"""Thread and signal settings of the daemons."""

from __future__ import annotations

import signal
import threading


def stop_on_signals(stop: threading.Event) -> None:
    """Make SIGTERM and SIGINT set `stop` (a graceful stop) instead of killing the process;
    only the main thread can install handlers, elsewhere (tests) this does nothing."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())


def one_blas_thread() -> None:
    """Keep a daemon's BLAS on one thread: an aggregator's vectors are too small to gain from
    more, and on a busy machine OpenBLAS's spinning threads made one dot product of the
    clipping norm (demo model) cost 12 ms of CPU, against 0.2 ms on one thread. Aggregators
    scale by processes (`edgefcl aggregator --role worker`)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
