"""The shared process supervisor (runtime/supervisor.py), the TOML-to-dataclass helper
(support/tomlfields.py) and the DeviceRunner hooks that firmware_sim uses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefcl.runtime.supervisor import Deadline, FleetError, Supervisor
from edgefcl.support.tomlfields import apply_table, coerce_field


def _python(code: str):
    def launch(log: Path) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen([sys.executable, "-c", code], stdout=f,
                                    stderr=subprocess.STDOUT)
    return launch


def _wait_exit(sup: Supervisor, name: str) -> None:
    deadline = time.monotonic() + 30
    while sup[name].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_supervisor_reports_the_failed_process_in_one_line(tmp_path):
    sup = Supervisor(tmp_path)
    sup.start("ok", _python("print('fine')"))
    sup.start("bad", _python("import sys; print('starting'); "
                             "print('bad: error: no such file x', file=sys.stderr); sys.exit(3)"))
    _wait_exit(sup, "ok")
    _wait_exit(sup, "bad")
    assert sup.exit_codes() == {"ok": 0, "bad": 3}
    assert not sup.running()
    with pytest.raises(FleetError) as e:
        sup.check()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bad exited with code 3: bad: error: no such file x")
    assert str(tmp_path / "bad.log") in msg
    sup.check(lambda name, code: name == "bad" or code == 0)  # allowed: no error


def test_supervisor_kills_stops_and_restarts(tmp_path):
    sup = Supervisor(tmp_path)
    sleeper = _python("import time; time.sleep(60)")
    sup.start("a", sleeper)
    sup.start("b", _python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "print('ready', flush=True); time.sleep(60)"))
    assert sup.running(lambda name: name == "a")
    sup.kill("a")
    assert sup.exit_codes()["a"] == -9
    first = sup["a"]
    sup.start("a", sleeper)  # a restart replaces the process under the same name and log
    assert sup["a"] is not first and sup["a"].poll() is None
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "b.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.stop("b", grace=0.5) == -9  # ignores SIGTERM: killed after the grace period
    sup.stop_all(grace=5)
    assert sup.exit_codes() == {"a": -15, "b": -9}


def test_deadline_raises_with_context():
    Deadline(60, lambda: "").check()
    with pytest.raises(FleetError, match=r"within 0 s \(progress 3 %\)"):
        d = Deadline(0, lambda: " (progress 3 %)")
        time.sleep(0.01)
        d.check()


@dataclasses.dataclass
class _Table:
    flag: bool = False
    rate: float = 1.0
    count: int = 2
    name: str = "x"
    items: list = dataclasses.field(default_factory=list)


@pytest.mark.parametrize("key,value,message", [
    ("nope", 1, "unknown key 'nope' in [t]; known: flag, rate, count, name, items"),
    ("flag", 1, "[t] flag must be true or false"),
    ("rate", "fast", "[t] rate must be a number"),
    ("rate", True, "[t] rate must be a number"),
    ("count", 2.5, "[t] count must be an integer"),
    ("name", 3, "[t] name must be a string"),
])
def test_coerce_field_refuses_in_one_line(key, value, message):
    with pytest.raises(ValueError, match=r"^p\.toml: " + message.replace("[", r"\[")
                       .replace("]", r"\]")):
        coerce_field(_Table, key, value, "t", ValueError, prefix="p.toml: ")


def test_apply_table_sets_typed_values():
    t = _Table()
    apply_table(t, "t", {"flag": True, "rate": 3, "count": 4, "name": "y", "items": [1]},
                ValueError)
    assert t == _Table(True, 3.0, 4, "y", [1]) and isinstance(t.rate, float)
    with pytest.raises(ValueError, match=r"^\[t\] must be a table$"):
        apply_table(t, "t", 5, ValueError)


def test_firmware_overrides_only_the_runner_hooks():
    from edgefcl.runtime.device_runner import DeviceRunner
    from firmware_sim.device import Firmware

    overridden = {n for n, v in vars(Firmware).items()
                  if callable(v) and n != "__init__" and hasattr(DeviceRunner, n)}
    assert overridden and not {n for n in overridden if n.startswith("_")}, overridden


def test_fleet_progress_counts_only_the_fleets_devices_and_their_streams(monkeypatch):
    # the attack: one status claiming 10**18 batches made the fleet's progress 10**15, so
    # every drill waiting on it (kill_at, cut_at, broker restarts) fired at once; a float or
    # a list raised in the network callback, a traceback per message
    from edgefcl.config import RunConfig, apply
    from edgefcl.runtime import supervisor
    from edgefcl.transport.codec import Message, encode

    monkeypatch.setattr(supervisor, "open_link", lambda *a, **k: type(
        "Link", (), {"subscribe": lambda *a, **k: None, "close": lambda self: None})())
    cfg = apply(RunConfig(), {"mqtt": {"fleet": "f"}, "quiet": True})
    p = supervisor.FleetProgress(cfg, 130, {"c000": 100, "c001": 30})

    def status(cid: str, consumed: object) -> None:
        p.on_status(p.topics.status(cid), encode(Message(
            "status", {"state": "online", "consumed": consumed}), fleet="f", sender=cid))

    status("evil", 10**18)  # not one of the fleet's devices
    for junk in (float("nan"), float("inf"), "12", [1], True, -5):
        status("c000", junk)
    assert p.batches == 0
    status("c000", 10**18)  # its own, but more than its stream
    status("c001", 30)
    assert p.consumed == {"c000": 100, "c001": 30} and p.fraction == 1.0
