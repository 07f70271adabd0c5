"""The `edgefcl` command end to end on small configurations."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefcl.cli import BENCHES, build_parser, main
from edgefcl.config import RunConfig, dump_toml, load_toml

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--tasks", "2", "--classes-per-task", "2", "--clients", "2", "--memory-size", "30",
         "--local-epochs", "1", "--burn-in", "2", "--jump", "2", "--quiet"]


def test_simulate_writes_results_and_plots(tmp_path, capsys):
    assert main(["simulate", *SMALL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "A = " in out and "F = " in out and "rounds = " in out
    r = json.loads((tmp_path / "results.json").read_text())
    for key in ("accuracy", "forgetting", "accuracy_matrix", "rounds", "bytes_up", "bytes_down",
                "global_sha256", "config"):
        assert key in r
    assert len(r["accuracy_matrix"]) == 2 and len(r["accuracy_matrix"][0]) == 2
    assert r["rounds"] > 0 and r["bytes_up"] > 0
    assert r["config"]["fed"]["clients"] == 2
    for png in ("accuracy_matrix.png", "accuracy_over_tasks.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_same_seed_same_global_and_other_seed_differs(tmp_path):
    hashes = []
    for seed, d in ((0, "a"), (0, "b"), (1, "c")):
        main(["simulate", *SMALL, "--seed", str(seed), "--out", str(tmp_path / d)])
        hashes.append(json.loads((tmp_path / d / "results.json").read_text())["global_sha256"])
    assert hashes[0] == hashes[1] != hashes[2]


def test_compare_prints_mean_and_std(tmp_path, capsys):
    loud = [a for a in SMALL if a != "--quiet"]
    assert main(["simulate", *loud, "--compare", "bi,fedavg", "--seeds", "2",
                 "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "3/4 runs done, about" in err  # the sweep's progress
    assert "±" in out and "bi" in out and "fedavg" in out
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert set(summary) == {"bi", "fedavg"} and summary["bi"]["seeds"] == 2
    assert (tmp_path / "bi" / "seed1" / "results.json").exists()


def test_toml_config_and_flags_override(tmp_path):
    cfg = RunConfig()
    cfg.fed.clients = 4
    cfg.learn.memory_size = 77
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(cfg))
    assert load_toml(path) == cfg
    args = build_parser().parse_args(["simulate", "--config", str(path), "--clients", "2"])
    from edgefcl.cli import config_from_args

    got = config_from_args(args)
    assert got.fed.clients == 2 and got.learn.memory_size == 77


def test_help_shows_the_common_options_and_help_all_every_one(capsys, monkeypatch):
    import dataclasses

    from edgefcl.config import SECTIONS

    monkeypatch.setenv("COLUMNS", "100")  # what a pipe gets
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--dataset", "--method", "--clients", "--tasks", "--batch-size",
                 "--memory-size", "--burn-in", "--jump", "--seed", "--seeds", "--compare",
                 "--device", "--out", "--transport", "--config", "--help-all"):
        assert flag in text
    assert "--bn-momentum" not in text and "--selection" not in text
    with pytest.raises(SystemExit):
        main(["simulate", "--help-all"])
    text = capsys.readouterr().out
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert "-" + f.name.replace("_", "-") in text, f.name


COMMANDS = [["simulate"], ["aggregator"], ["client"], ["replay"], ["status"], ["broker"],
            ["report"], ["export"], ["predict"], ["bench"],
            *[["bench", what] for what in BENCHES]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_commands_help_fits_60_lines(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 60, "\n".join(lines)


@pytest.mark.parametrize("what,shown,hidden", [
    ("backpressure", ["--devices", "--seed", "--seeds", "--out"],
     ["--method", "--dataset", "--memory-size", "--clients", "--device "]),
    ("fleet", ["--devices", "--out", "--max-backpressure", "--topk", "--global-topk"],
     ["--method", "--memory-size", "--seeds"]),
    ("crash", ["--count", "--out"], ["--method", "--dataset", "--memory-size"]),
    ("client", ["--method", "--dataset", "--memory-size", "--device", "--repeats"],
     ["--max-backpressure"]),
])
def test_a_benchs_help_shows_the_options_it_uses(what, shown, hidden, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["bench", what, "--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"usage: edgefcl bench {what} [options]\n")
    for flag in shown:
        assert flag in text, flag
    for flag in hidden:
        assert flag not in text, flag


def test_hidden_options_still_parse():
    args = build_parser().parse_args(["simulate", "--bn-momentum", "0.2", "--selection", "top"])
    assert vars(args)["learn.bn_momentum"] == 0.2 and vars(args)["learn.selection"] == "top"


@pytest.mark.parametrize("argv,prog", [
    (["simulate", "--nope"], "edgefcl simulate"), (["simulate", "--clients", "abc"],
                                                   "edgefcl simulate"),
    (["bench", "fleet", "--nope"], "edgefcl bench fleet"), (["status", "--nope"],
                                                            "edgefcl status"),
    # no abbreviations: --worker-id was taken as --worker-ids (an operator's typo of --id)
    (["aggregator", "--role", "worker", "--worker-id", "w1"], "edgefcl aggregator"),
    (["simulate", "--seed", "1", "--method", "bi", "--memory", "5"], "edgefcl simulate"),
])
def test_a_bad_flag_points_to_its_commands_help(argv, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error: ") and err.endswith(f"(see {prog} --help)")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--method", "nope"], "unknown method"),
    (["simulate", "--dataset", "npz:/does/not/exist.npz"], "exist.npz"),
    (["simulate", "--config", "/no/such.toml"], "config file not found"),
    (["simulate", "--jump", "0"], "jump"),
    (["simulate", "--device", "cuda:7", "--clients", "1", "--tasks", "1"], "CUDA"),
    (["simulate", "--export-onnx", "/proc/nope/{cid}.onnx", "--clients", "1", "--tasks", "1"],
     "--export-onnx: cannot create folder /proc/nope"),
])
def test_bad_input_gives_a_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgefcl: error:") and needle in err
    assert "Traceback" not in err


def test_status_without_a_broker_is_one_line(capfd):
    assert main(["status", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "1",
                 "--once"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("edgefcl: error: cannot reach the MQTT broker") and "\n" not in err


def test_missing_broker_is_a_clear_error(capsys):
    assert main(["replay", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "1",
                 "--clients", "1", "--tasks", "1"]) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1:9" in err and "broker" in err


@pytest.mark.mqtt
def test_aggregator_daemon_stops_gracefully_on_sigterm(embedded_broker, tmp_path):
    import numpy as np

    from edgefcl.support.statefiles import save_tensors

    save_tensors(tmp_path / "init.npz", {"w": np.zeros(3, np.float32)})
    p = subprocess.Popen([sys.executable, "-m", "edgefcl", "aggregator", "--broker",
                          embedded_broker, "--fleet", "sig", "--initial",
                          str(tmp_path / "init.npz"), "--state-dir", str(tmp_path / "st")])
    deadline = time.monotonic() + 30
    while not (tmp_path / "st" / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0
    state = json.loads((tmp_path / "st" / "state.json").read_text())
    assert state["version"] == 0


def test_broker_port_taken_names_its_owner(capsys):
    import socket

    from edgefcl.transport.port_owner import port_owner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_owner(port).endswith(f"(pid {os.getpid()})")
        assert main(["broker", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"pid {os.getpid()}" in err and "--port" in err


def test_the_broker_variable_is_the_default_broker(monkeypatch):
    from edgefcl.options import daemon_config
    from edgefcl.runtime.roles import add_role_commands

    parser = argparse.ArgumentParser()
    add_role_commands(parser.add_subparsers(dest="command"))
    monkeypatch.setenv("EDGEFCL_BROKER", "mqtt://127.0.0.1:1999")
    args = parser.parse_args(["client", "--config", str(REPO / "examples/fleet.toml")])
    assert daemon_config(args).mqtt.broker == "mqtt://127.0.0.1:1999"  # over the TOML's
    args = parser.parse_args(["client", "--broker", "mqtt://127.0.0.1:7"])
    assert daemon_config(args).mqtt.broker == "mqtt://127.0.0.1:7"  # the flag wins


def test_a_round_that_cannot_fit_its_memory_bound_is_refused(tmp_path, capsys):
    """A rule that holds every update of a round (median) with `min_clients` updates over
    `round_max_mib`: one line naming both options, before any broker is reached."""
    import numpy as np

    from edgefcl.support.statefiles import save_tensors

    save_tensors(tmp_path / "init.npz", {"w": np.zeros(10_000, np.float32)})
    argv = ["aggregator", "--broker", "mqtt://127.0.0.1:9", "--initial",
            str(tmp_path / "init.npz"), "--state-dir", str(tmp_path / "st"), "--mode", "async",
            "--aggregation", "median", "--min-clients", "500", "--round-max-mib", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--min-clients 500 x 39 KiB = 19.1 MiB is over --round-max-mib 1" in err
    assert "Traceback" not in err


def test_replays_help_all_lists_what_it_reads_and_it_accepts_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["replay", "--help-all"])
    text = capsys.readouterr().out
    for flag in ("--dataset", "--batch-size", "--tasks", "--seed", "--clients", "--method",
                 "--head", "--broker", "--fleet"):
        assert flag + " " in text, flag
    for flag in ("--memory-size", "--aggregation", "--lr", "--burn-in"):
        assert flag + " " not in text, flag
    args = build_parser().parse_args(["replay", "--memory-size", "50", "--burn-in", "3"])
    assert vars(args)["learn.memory_size"] == 50  # one command line serves every role


def test_an_export_folder_it_cannot_write_is_refused_before_training(tmp_path, capsys,
                                                                      monkeypatch):
    # a deployer helper's report: on a read-only mount the folder existed, and the client
    # died with an OSError traceback at its first global
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path)
                        else real(p, mode))
    assert main(["simulate", "--export-onnx", str(tmp_path / "{cid}.onnx"), "--clients", "1",
                 "--tasks", "1"]) == 2
    assert f"--export-onnx: cannot write in folder {tmp_path}" in capsys.readouterr().err


def test_an_export_that_fails_later_is_logged_and_the_client_learns_on(tmp_path, capsys,
                                                                        monkeypatch):
    import edgefcl.learn.scoring.snapshot as snapshot

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "export_onnx", full)
    assert main(["simulate", "--export-onnx", str(tmp_path / "{cid}.onnx"), "--clients", "2",
                 "--tasks", "2", "--quiet"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "cannot write the model" in ln]
    assert len(lines) == 2 and "No space left on device" in lines[0]  # once each client


def test_an_option_of_another_role_is_said_to_be_ignored(caplog):
    # an operator's finding: a root given --id and --share-group started as if they meant
    # something
    import argparse
    import logging

    from edgefcl.runtime.roles import role_options

    args = argparse.Namespace(role="root", worker_ids=None, id="x", share_group="g",
                              upstream=None, flush_every=None, state_dir=None, initial=None,
                              eval_data=None, fresh=False, resume=False)
    with caplog.at_level(logging.WARNING, logger="edgefcl"):
        role_options(args)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--id applies to --role worker/site only: ignored for --role root" in said
    assert "--share-group applies to --role worker only" in said and "--upstream" not in said
    assert args.worker_ids == "w0,w1" and args.flush_every == 0.5  # the defaults filled in
