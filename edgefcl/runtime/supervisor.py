"""One process supervisor for the fleet launchers (`simulate --transport mqtt` in fleet.py and
`python -m firmware_sim fleet`): named child processes, each logging to `<logs>/<name>.log`;
start, watch for failures, restart, kill, stop, and collect their exit codes. `FleetProgress`
follows the fleet's status topics (batches consumed per device, the aggregator's status)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from edgefcl.config import RunConfig
from edgefcl.runtime.bodies import is_int
from edgefcl.runtime.links import open_link, status_body, topics
from edgefcl.support.errors import UserError


class FleetError(UserError):
    """A fleet process failed or the fleet ran out of time; one line that says which process,
    its own error line (or last log line) and where its log is."""


class Process(Protocol):
    """What the supervisor needs of a child: `subprocess.Popen` or a launcher `Role`."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def log_error_line(log: Path) -> str:
    """The last `...: error: ...` line of `log`, else its last line, else 'no output'."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()[-200:]
             if ln.strip()] if log.exists() else []
    errors = [ln for ln in lines if ": error: " in ln]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


class Supervisor:
    """Named child processes of one fleet run, each with its log in `logs`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, Process] = {}

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def start(self, name: str, launch: Callable[[Path], Process]) -> Process:
        """Start `name` (again, after an exit or a kill): `launch(log path)` makes the process."""
        self.procs[name] = launch(self.log_path(name))
        return self.procs[name]

    def __getitem__(self, name: str) -> Process:
        return self.procs[name]

    def exit_codes(self) -> dict[str, int | None]:
        """Every process's exit code, None for those still running."""
        return {name: p.poll() for name, p in self.procs.items()}

    def running(self, names: Callable[[str], bool] = lambda name: True) -> bool:
        """Whether any process whose name `names` accepts is still running."""
        return any(code is None for name, code in self.exit_codes().items() if names(name))

    def failure(self, name: str, code: int | None) -> FleetError:
        return FleetError(f"{name} exited with code {code}: "
                          f"{log_error_line(self.log_path(name))} (log: {self.log_path(name)})")

    def check(self, fine: Callable[[str, int], bool] = lambda name, code: code == 0) -> None:
        """Raise FleetError for the first process that exited in a way `fine` refuses."""
        for name, code in self.exit_codes().items():
            if code is not None and not fine(name, code):
                raise self.failure(name, code)

    def kill(self, name: str) -> None:
        """SIGKILL `name` and reap it."""
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self, name: str, grace: float, sig: int = signal.SIGTERM) -> int | None:
        """Send `sig`, wait up to `grace` s, then SIGKILL; the exit code."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        return self._reap(p, grace)

    def stop_all(self, grace: float) -> None:
        """SIGTERM every running process and give them `grace` s to exit, then SIGKILL; with
        `grace` 0, SIGKILL at once."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            if grace > 0:
                p.terminate()
            else:
                p.kill()
        for p in alive:
            self._reap(p, grace)

    @staticmethod
    def _reap(p: Process, grace: float) -> int | None:
        try:
            return p.wait(grace if grace > 0 else None)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()


class FleetProgress:
    """The fleet's progress from its status topics: batches consumed per device (the most each
    reported, of the fleet's own devices, at most its stream's) and the aggregator's last
    status (with how many arrived). `streams`: each device's batches. One status claiming
    10**18 batches had every drill that waits on the fleet's progress fire at once."""

    def __init__(self, cfg: RunConfig, total: int, streams: dict[str, int]) -> None:
        self.fleet = cfg.mqtt.fleet
        self.topics = topics(cfg.mqtt)
        self.total = total
        self.streams = streams
        self.consumed: dict[str, int] = {}
        self.aggregator: dict[str, Any] = {}
        self.aggregator_statuses = 0
        self.link = open_link(cfg.mqtt, f"{self.fleet}-watch-{secrets.token_hex(3)}",
                              clean_start=True)
        self.link.subscribe(self.topics.statuses, self.on_status)
        self.link.subscribe(self.topics.aggregator_status, self.on_status)

    def on_status(self, topic: str, payload: bytes) -> None:
        body = status_body(payload, self.fleet)
        if body is None:
            return
        if topic == self.topics.aggregator_status:
            self.aggregator = body
            self.aggregator_statuses += 1
        else:
            cid, n = self.topics.client_from(topic), body.get("consumed")
            if cid in self.streams and is_int(n) and n >= 0:
                self.consumed[cid] = min(max(self.consumed.get(cid, 0), n), self.streams[cid])

    @property
    def batches(self) -> int:
        return sum(self.consumed.values())

    @property
    def fraction(self) -> float:
        """Batches consumed / batches in all streams (at most 1)."""
        return min(1.0, self.batches / max(self.total, 1))

    def close(self) -> None:
        self.link.close()


class Deadline:
    """`timeout` seconds from now; `check()` raises FleetError once they have passed."""

    def __init__(self, timeout: float, what: Callable[[], str]) -> None:
        self.timeout, self.what = timeout, what
        self.at = time.monotonic() + timeout

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise FleetError(f"the fleet did not finish within {self.timeout:.0f} s"
                             f"{self.what()}")
