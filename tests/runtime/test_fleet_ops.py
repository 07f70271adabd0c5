"""Operating a networked fleet by hand, over a real Mosquitto: the join check, `edgefcl status`
(JSON and a live table in a real terminal), the aggregator's fleet results, `report` and
`export` on its state directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]

FLEET_TOML = """seed = 0
[data]
dataset = "digits"
tasks = 2
classes_per_task = 2
[learn]
memory_size = 30
local_epochs = 1
[fed]
clients = 2
burn_in = 2
jump = 2
mode = "async"
min_clients = 1
round_timeout = 2.0
"""
# min_clients 1: the clients read their streams locally, unpaced, and one can finish before the
# other joins; the quorum counts distinct clients, so with 2 it would train alone (and exit 1).
# These tests are about operating a fleet; the quorum has its own tests (test_admission.py).


def edgefcl(*args: str, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefcl", *args], capture_output=True,
                          text=True, timeout=timeout, **kw)


def wait_for(pred, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def fleet(mosquitto, tmp_path):
    """A running aggregator (with --eval-data) for fleet 'ops' on a fresh Mosquitto."""
    conf = tmp_path / "fleet.toml"
    conf.write_text(FLEET_TOML)
    common = ["--config", str(conf), "--broker", mosquitto, "--fleet", "ops"]
    with open(tmp_path / "aggregator.log", "w") as log:
        agg = subprocess.Popen([sys.executable, "-m", "edgefcl", "aggregator", *common,
                                "--state-dir", str(tmp_path / "state"), "--eval-data",
                                "config"], stdout=log, stderr=subprocess.STDOUT)
        try:
            yield common, agg, tmp_path
        finally:
            agg.terminate()
            agg.wait(20)


def test_fleet_operations_end_to_end(fleet):
    common, agg, tmp = fleet
    # a device with another model refuses at once, naming the difference
    t0 = time.monotonic()
    bad = edgefcl("client", *common, "--index", "0", "--model", "mlp", "--source", "local")
    elapsed = time.monotonic() - t0
    print(f"mismatched client exited after {elapsed:.1f} s")
    assert bad.returncode == 2, bad.stderr
    err = bad.stderr.strip().splitlines()
    assert err[-1].startswith("edgefcl: error: c000 does not match fleet 'ops'")
    assert "model mlp here, cnn at the aggregator" in err[-1]
    assert "Traceback" not in bad.stderr
    # so does one in the other round mode, on another seed: refused before it loads anything,
    # and the operator's status shows it refused, with the reason
    wrong = edgefcl("client", *common, "--index", "1", "--mode", "sync", "--seed", "5",
                    "--source", "local")
    assert wrong.returncode == 2, wrong.stderr
    line = wrong.stderr.strip().splitlines()[-1]
    assert "mode sync here, async at the aggregator" in line and "seed 5 here, 0" in line
    status = json.loads(edgefcl("status", *common, "--json").stdout)
    assert status["devices"]["c001"]["state"] == "refused"
    assert "mode sync here" in status["devices"]["c001"]["reason"]

    # two matching devices federate and write their results
    clients = [subprocess.Popen([sys.executable, "-m", "edgefcl", "client", *common, "--index",
                                 str(k), "--source", "local", "--results", str(tmp / "res")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for k in range(2)]
    outs = [c.communicate(timeout=300) for c in clients]
    for c, (out, errs) in zip(clients, outs, strict=True):
        assert c.returncode == 0, errs
        assert "globals merged" in out and ", F = " in out
    for k in range(2):
        r = json.loads((tmp / "res" / f"c00{k}.json").read_text())
        assert {"accuracy", "forgetting", "accuracy_matrix"} <= set(r)
        assert r["rounds"] > 0

    # the aggregator sums the fleet up once every client is done
    log = tmp / "aggregator.log"
    assert wait_for(lambda: "all clients done" in log.read_text()), log.read_text()[-3000:]
    state = tmp / "state"
    assert wait_for(lambda: (state / "results.json").is_file())
    res = json.loads((state / "results.json").read_text())
    assert res["rounds"] > 0 and len(res["accuracy_matrix"]) == 2
    assert res["labels"] == [str(c) for c in range(10)]
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert rounds and all(0 <= r["accuracy"] <= 100 for r in rounds)

    # status: JSON snapshot of the aggregator and every device (the aggregator publishes its
    # status when the run ends, just after results.json: read it until it has the last round)
    def snapshot() -> dict:
        snap = edgefcl("status", *common, "--once", "--json")
        assert snap.returncode == 0, snap.stderr
        return json.loads(snap.stdout)

    s = snapshot()
    for _ in range(10):
        if s["aggregator"].get("rounds") == res["rounds"]:
            break
        time.sleep(0.5)
        s = snapshot()
    assert s["aggregator"]["state"] == "online" and s["aggregator"]["rounds"] == res["rounds"]
    assert s["aggregator"]["accuracy"] == rounds[-1]["accuracy"]
    assert set(s["devices"]) == {"c000", "c001"}
    for d in s["devices"].values():
        assert d["state"] == "done" and d["batches"] > 0 and d["prequential"] is not None
        assert d["rejected"] == 0 and d["last_seen_s"] >= 0

    # report and export work on the aggregator's state directory
    rep = edgefcl("report", str(state))
    assert rep.returncode == 0, rep.stderr
    assert "all clients done" in rep.stdout and "A = " in rep.stdout
    assert (state / "rounds.png").stat().st_size > 1000
    exp = edgefcl("export", "--run", str(state))
    assert exp.returncode == 0, exp.stderr
    x = tmp / "x.npy"
    np.save(x, np.random.default_rng(0).random((5, 1, 8, 8), np.float32))
    pred = edgefcl("predict", "--model", str(state / "model.onnx"), "--input", str(x))
    assert pred.returncode == 0, pred.stderr
    assert "predicted classes:" in pred.stdout

    # a live table in a real terminal
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock = f"edgefcl-test-{os.getpid()}"
    cmd = (f"env PYTHONPATH={os.environ.get('PYTHONPATH', '')} {sys.executable} -m edgefcl "
           f"status {' '.join(common)} --interval 0.5")
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-x", "140", "-y", "30", cmd],
                   check=True)
    try:
        def screen() -> str:
            return subprocess.run(["tmux", "-L", sock, "capture-pane", "-p"],
                                  capture_output=True, text=True).stdout

        assert wait_for(lambda: "c001" in screen(), 60), screen()
        first = screen()
        assert "fleet ops on" in first and "aggregator: online" in first
        assert "Ctrl-C to quit" in first and first.count("fleet ops on") == 1  # redrawn
        clock = first.splitlines()[0]
        assert wait_for(lambda: screen().splitlines()[0] != clock, 10)  # it refreshes
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


def test_finished_state_is_refused_and_devices_do_not_train_alone(fleet):
    """Running the same fleet again on a finished state directory: the aggregator refuses at
    once, and a device waiting for it refuses too instead of training alone."""
    common, agg, tmp = fleet
    clients = [subprocess.Popen([sys.executable, "-m", "edgefcl", "client", *common, "--index",
                                 str(k), "--source", "local"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for k in range(2)]
    for c in clients:
        _, err = c.communicate(timeout=300)
        assert c.returncode == 0, err[-3000:]
    log = tmp / "aggregator.log"
    assert wait_for(lambda: "all clients done" in log.read_text())
    agg.terminate()
    agg.wait(20)
    device = subprocess.Popen([sys.executable, "-m", "edgefcl", "client", *common, "--index",
                               "0", "--source", "local"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    again = edgefcl("aggregator", *common, "--state-dir", str(tmp / "state"), "--eval-data",
                    "config")
    # the stream's replayer, started with it, says the aggregator's refusal itself, in one
    # line, rather than through a device
    replay = subprocess.Popen([sys.executable, "-m", "edgefcl", "replay", *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("edgefcl: error: ")
    assert "holds a finished run" in again.stderr and "--fresh" in again.stderr
    assert "held-out" not in again.stderr  # refused before it loads its data
    out, err = device.communicate(timeout=120)
    assert device.returncode == 2, (out, err)
    assert "refused to start" in err and "batches" not in out
    _, err = replay.communicate(timeout=120)
    assert replay.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("edgefcl: error: the aggregator of fleet 'ops' refused to start:")
    assert "holds a finished run" in last and "refused to join" not in last
