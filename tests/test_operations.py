"""Operating edgefcl: CLI conventions, one-line errors, run directories that survive and
reproduce, reports and plots, progress output."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from edgefcl.cli import build_parser, main

SMALL = ["--tasks", "2", "--classes-per-task", "2", "--clients", "2", "--memory-size", "30",
         "--local-epochs", "1", "--burn-in", "2", "--jump", "2", "--quiet"]


def one_line_error(capsys, prog: str = "edgefcl") -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and err.splitlines()[-1] == lines[0], err
    assert prog in lines[0].split(": error: ")[0], err
    return lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from edgefcl.version import __version__

    assert capsys.readouterr().out.strip() == f"edgefcl {__version__}"


@pytest.mark.parametrize("command", ["simulate", "aggregator", "client", "replay", "status",
                                     "broker", "export", "report", "predict", "bench"])
def test_logging_options_after_any_subcommand(command):
    p = build_parser()
    required = {"export": ["--run", "x"], "report": ["x"], "bench": ["client"],
                "predict": ["--model", "m", "--input", "x"]}.get(command, [])
    for flags, want in ((["-v"], "verbose"), (["-q"], "log_quiet"),
                        (["--log-level", "error"], "log_level"), (["--log-json"], "log_json")):
        args = p.parse_args([command, *required, *flags])
        assert getattr(args, want)
    args = p.parse_args(["-v", command, *required])  # and before it
    assert args.verbose


@pytest.mark.parametrize("command", ["aggregator", "client", "replay"])
@pytest.mark.parametrize("flag", [["--compare", "bi,er"], ["--seeds", "3"], ["--out", "x"],
                                  ["--transport", "mqtt"]])
def test_daemons_refuse_options_they_would_ignore(command, flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, *flag])
    assert e.value.code == 2
    assert "unrecognized arguments" in one_line_error(capsys)


def test_an_unknown_flag_before_any_command_is_named(capsys):
    # `edgefcl --bogus` said "the following arguments are required: COMMAND"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bogus"])
    assert one_line_error(capsys).startswith(
        "edgefcl: error: unrecognized arguments: --bogus; give a command first")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-v"])
    assert "the following arguments are required: COMMAND" in one_line_error(capsys)


def test_help_shows_each_commands_own_options_with_defaults(capsys):
    texts = {}
    for command in ("aggregator", "broker", "export", "predict", "status", "simulate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())
    assert "EDGEFCL_BROKER if set, else 1883)" in texts["broker"]
    assert "EDGEFCL_BROKER if set, else 127.0.0.1)" in texts["broker"]
    assert "(default: torchscript)" in texts["export"]
    assert "(default: 1)" in texts["predict"]
    assert "else mqtt://127.0.0.1:1883" in texts["aggregator"]
    assert "empty: start an embedded broker" not in texts["aggregator"]
    assert "--seeds" not in texts["aggregator"] and "--compare" not in texts["aggregator"]
    assert "--memory-size" not in texts["status"] and "--fleet" in texts["status"]
    assert "--resume" in texts["simulate"] and "--log-level" in texts["simulate"]


def test_firmware_sim_help_explains_every_option(capsys):
    from firmware_sim.__main__ import build_parser as fw_parser

    p = fw_parser()
    for sub in ("fleet", "device"):
        parser = p._subparsers._group_actions[0].choices[sub]
        for a in parser._actions:
            if a.option_strings and a.dest != "help":
                assert a.help, f"firmware_sim {sub} {a.option_strings} has no help"


@pytest.fixture
def npy_input(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((2, 1, 8, 8), np.float32))
    return path


BAD_INPUT = [
    (["simulate", "--aggregation", "nope"], "unknown aggregation 'nope'"),
    (["simulate", "--jump", "x"], "invalid int value"),
    (["simulate", "--resume"], "--resume needs --out"),
    (["simulate", "--transport", "mqtt", "--broker", "mqtt://127.0.0.1:9",
      "--connect-timeout", "1"], "127.0.0.1:9"),
    (["simulate", "--transport", "mqtt", "--device", "cuda"], "CUDA"),
    (["simulate", "--out", "/proc/edgefcl-no/run", *SMALL], "cannot create"),
    (["aggregator", "--state-dir", "/proc/edgefcl-no/state"], "cannot create /proc"),
    (["aggregator", "--initial", "/no/such.npz", "--state-dir", "{tmp}/st"], "no such file"),
    (["aggregator", "--aggregation", "median-of-nothing"], "unknown aggregation"),
    (["client", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "1", "--clients", "1",
      "--tasks", "1"], "127.0.0.1:9"),
    (["client", "--index", "7", "--clients", "1", "--tasks", "1", "--broker",
      "mqtt://127.0.0.1:9"], "--index"),
    (["replay", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "1", "--clients", "1",
      "--tasks", "1"], "127.0.0.1:9"),
    (["status", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "1"], "127.0.0.1:9"),
    (["status", "--broker", "http://x"], "broker must look like"),
    (["export", "--run", "/no/such/run"], "not a run directory"),
    (["report", "/no/such/run"], "no such directory"),
    (["predict", "--model", "/no/such.onnx", "--input", "{x}"], "not found"),
    (["predict", "--model", "/no/such.onnx", "--input", "{x}", "--output", "/no/dir/p.npy"],
     "does not exist"),
    (["broker", "--port", "70000"], "port must be 0-65535"),
    (["report", "{x}"], "is a file; pass its folder"),
    (["export", "--run", "{tmp}", "--output", "/no/dir/m.onnx"], "not a run directory"),
    (["bench", "nope"], "invalid choice"),
    (["nope"], "invalid choice"),
]


@pytest.mark.parametrize("argv,needle", BAD_INPUT, ids=[" ".join(a[:2]) + f" #{i}"
                                                        for i, (a, _) in enumerate(BAD_INPUT)])
def test_every_user_error_is_one_line_with_exit_code_2(argv, needle, capsys, tmp_path,
                                                       npy_input):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{x}", str(npy_input)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    assert code == 2
    assert needle in one_line_error(capsys)


@pytest.mark.parametrize("argv,needle", [
    (["device", "--config", "/no/such.toml", "--index", "0"], "not found"),
    (["device", "--devices-file", "/no/such.json", "--config", "{cfg}"], "--devices-file"),
    (["device", "--config", "{cfg}", "--index", "9"], "out of range"),
    (["fleet", "--devices", "x"], "invalid int value"),
    (["fleet", "--profile", "/no/such.toml"], "not found"),
])
def test_firmware_sim_user_errors_are_one_line(argv, needle, capsys, tmp_path):
    from edgefcl.config import RunConfig, dump_toml
    from firmware_sim.__main__ import main as fw_main

    cfg = tmp_path / "fleet.toml"
    c = RunConfig()
    c.mqtt.broker = "mqtt://127.0.0.1:9"
    cfg.write_text(dump_toml(c))
    argv = [a.replace("{cfg}", str(cfg)) for a in argv]
    try:
        code = fw_main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert needle in one_line_error(capsys, "firmware_sim")


def test_run_directory_reproduces_and_records_its_environment(tmp_path, capsys):
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "a")]) == 0
    r = json.loads((tmp_path / "a" / "results.json").read_text())
    env = r["environment"]
    for key in ("edgefcl", "torch", "python", "numpy", "git_commit", "host", "started"):
        assert key in env
    assert env["torch"].startswith("2.") and env["host"]
    assert r["labels"] == [str(c) for c in range(10)]
    assert main(["simulate", "--config", str(tmp_path / "a" / "config.toml"), "--quiet",
                 "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "results.json").read_text())
    assert again["global_sha256"] == r["global_sha256"]
    assert again["accuracy_matrix"] == r["accuracy_matrix"]


def test_compare_writes_each_run_as_it_finishes_and_resumes(tmp_path, capsys, monkeypatch):
    import edgefcl.runner as runner

    out = tmp_path / "cmp"
    real = runner.run_one
    calls = []

    def interrupted(cfg, method, seed, label=None, position=None):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append((label, seed))
        return real(cfg, method, seed, label, position)

    monkeypatch.setattr(runner, "run_one", interrupted)
    argv = ["simulate", *SMALL, "--compare", "fedavg,er", "--seeds", "2", "--out", str(out)]
    assert main(argv) == 130  # Ctrl-C during the third run
    assert (f"2 of 4 runs finished, in {out}; the same command with --resume runs the "
            "rest") in capsys.readouterr().err
    for seed in (0, 1):
        assert (out / "fedavg" / f"seed{seed}" / "results.json").is_file()
        assert (out / "fedavg" / f"seed{seed}" / "config.toml").is_file()
    assert not (out / "er").exists()
    calls.clear()
    monkeypatch.setattr(runner, "run_one", lambda *a: calls.append(a[1:]) or real(*a))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert [(c[0], c[1]) for c in calls] == [("er", 0), ("er", 1)]  # only the missing ones
    assert [c[3] for c in calls] == ["run 3/4", "run 4/4"]  # their places in the sweep
    assert "2 finished run(s) kept" in capsys.readouterr().out
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["fedavg"]["seeds"] == 2 and summary["er"]["seeds"] == 2
    # resuming with another configuration is refused, never mixed in
    assert main([*argv, "--resume", "--memory-size", "31"]) == 2
    said = one_line_error(capsys)
    assert "another configuration" in said and "memory_size" in said and "31 here" in said
    # a subset of the same runs is accepted, runs nothing and keeps the whole summary
    calls.clear()
    subset = ["simulate", *SMALL, "--compare", "er", "--seeds", "1", "--out", str(out)]
    assert main([*subset, "--resume"]) == 0 and calls == []
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["seed"]) for r in runs] == [("fedavg", 0), ("fedavg", 1), ("er", 0),
                                                        ("er", 1)]
    # one run resumed into the comparison's folder is refused: it would replace the summary
    capsys.readouterr()
    assert main(["simulate", *SMALL, "--out", str(out), "--resume"]) == 2
    assert "holds a comparison of 4 runs" in one_line_error(capsys)


def test_resume_never_mixes_a_run_of_other_options_into_the_summary(tmp_path, capsys):
    # a researcher's report: a second and a third sweep into the same folder with --resume
    # (another memory size, another dataset) listed every method side by side in one table
    out = tmp_path / "mix"
    assert main(["simulate", *SMALL, "--compare", "fedavg", "--out", str(out)]) == 0
    other = ["simulate", *SMALL, "--compare", "er", "--out", str(out), "--resume"]
    capsys.readouterr()
    assert main([*other, "--memory-size", "20"]) == 2  # fedavg seed 0 there had memory 30
    assert "holds a run of another configuration (fedavg seed 0)" in one_line_error(capsys)
    assert main(other) == 0  # the same options: fedavg is kept beside er, and said so
    assert "the summary keeps 1 finished run not in this sweep: fedavg seed 0" in \
        capsys.readouterr().out
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["seed"]) for r in runs] == [("fedavg", 0), ("er", 0)]


def test_a_run_never_replaces_runs_of_other_options_unasked(tmp_path, capsys):
    # a researcher's report: a second command into the same --out (other options) silently
    # replaced the finished runs there
    out = tmp_path / "r"
    assert main(["simulate", *SMALL, "--out", str(out)]) == 0
    before = (out / "results.json").read_text()
    capsys.readouterr()
    assert main(["simulate", *SMALL, "--memory-size", "20", "--out", str(out)]) == 2
    assert f"--out {out} already holds runs of other options; add --overwrite" in \
        one_line_error(capsys)
    assert main(["simulate", *SMALL, "--compare", "fedavg", "--seeds", "2",
                 "--out", str(out)]) == 2  # a comparison over one run's folder
    assert "add --overwrite" in one_line_error(capsys)
    assert (out / "results.json").read_text() == before
    assert main(["simulate", *SMALL, "--out", str(out)]) == 0  # the same options: run again
    assert f"{out} holds 1 finished run(s) of these options: this command runs them again " \
        "(--resume keeps them)" in capsys.readouterr().err
    assert main(["simulate", *SMALL, "--memory-size", "20", "--out", str(out),
                 "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["learn"]["memory_size"] == 20
    cmp = tmp_path / "cmp"  # the diff reviewer: a subset of a comparison dropped the others
    assert main(["simulate", *SMALL, "--compare", "fedavg,er", "--out", str(cmp)]) == 0
    capsys.readouterr()
    assert main(["simulate", *SMALL, "--compare", "fedavg", "--out", str(cmp)]) == 2
    assert "holds runs this command does not run (er seed 0); --resume keeps them" in \
        one_line_error(capsys)
    assert main(["simulate", *SMALL, "--out", str(out), "--overwrite", "--resume"]) == 2
    assert "give one of them" in one_line_error(capsys)
    (out / "results.json").write_text("{")  # a file it cannot read is not replaced unasked
    assert main(["simulate", *SMALL, "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert "not valid JSON" in err and "add --overwrite to replace it" in err


def test_a_fleet_whose_updates_were_all_rejected_says_so(capsys):
    # a researcher's report: --lr -1 ran, every update was rejected (range), and the run
    # said "every client trained alone" with "per round: up 17.2 MB" for 0 rounds
    assert main(["simulate", *SMALL, "--lr", "5"]) == 0
    out, err = capsys.readouterr()
    assert "rounds = 0" in out and "per round" not in out
    assert "the aggregator rejected its updates (range" in err
    assert "learning rate too large (--lr)" in err


def test_a_quorum_the_fleet_cannot_reach_is_said_before_the_run(capsys):
    # a researcher's report: --min-clients 5 with 3 clients ran the whole run, and only then
    # said the fleet never federated
    assert main(["simulate", *SMALL, "--min-clients", "3"]) == 0
    err = capsys.readouterr().err
    assert "--min-clients 3 is more than --clients 2: no round can close" in err


def test_a_method_named_twice_is_refused(capsys):
    assert main(["simulate", *SMALL, "--compare", "er,fedavg,er"]) == 2
    assert "--compare names er twice" in one_line_error(capsys)


def test_report_renders_run_and_compare_directories(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["simulate", *SMALL, "--compare", "fedavg", "--seeds", "2",
                 "--out", str(out)]) == 0
    for png in ("comparison.png",):
        (out / png).unlink()
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean ± sample standard deviation" in text and "fedavg" in text
    assert (out / "comparison.png").stat().st_size > 1000
    assert main(["report", str(out / "fedavg" / "seed1")]) == 0
    assert "A = " in capsys.readouterr().out
    (out / "results.json").unlink()  # a sweep stopped before its summary (a researcher's)
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean ± sample standard deviation" in text and "the 2 runs it finished" in text


def test_a_broken_or_foreign_results_file_is_a_one_line_error(tmp_path, capsys):
    # a researcher's report: `report` and `simulate --resume` on a results.json cut short by
    # an interrupted write ended in a JSONDecodeError traceback
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text('{"runs": [')
    assert main(["report", str(broken)]) == 2
    assert f"{broken}/results.json: not valid JSON" in one_line_error(capsys)
    assert main(["simulate", *SMALL, "--compare", "er", "--out", str(broken), "--resume"]) == 2
    assert "not valid JSON" in one_line_error(capsys)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.json").write_text('{"x": 1}')
    assert main(["report", str(foreign)]) == 2
    assert "its results.json is neither a run's nor a comparison's" in one_line_error(capsys)
    assert main(["report", str(foreign / "results.json")]) == 2
    assert f"is a file; pass its folder: edgefcl report {foreign}" in one_line_error(capsys)
    (foreign / "results.json").write_text('{"accuracy_matrix": [[[1]]]}')  # keys missing
    assert main(["report", str(foreign)]) == 2
    assert f"{foreign}/results.json: not a run's results" in one_line_error(capsys)
    run = tmp_path / "sweep" / "er" / "seed0"
    run.mkdir(parents=True)
    (run / "results.json").write_text("{}")
    (run / "config.toml").write_text("")
    assert main(["simulate", *SMALL, "--compare", "er,fedavg", "--out", str(tmp_path / "sweep"),
                 "--resume"]) == 2
    assert "seed0/results.json: not a run's results" in one_line_error(capsys)


def test_output_cut_short_by_a_closed_pipe_is_no_traceback():
    # `edgefcl simulate --compare ... | head -1`: the second run's table went to a closed pipe
    import subprocess
    import sys

    cmd = f"{sys.executable} -m edgefcl simulate {' '.join(SMALL)} --compare er,fedavg | head -1"
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("method er") and "Traceback" not in proc.stderr, proc.stderr


def test_report_of_a_folder_that_holds_runs_names_them(tmp_path, capsys):
    (tmp_path / "fleet" / "bi-seed0" / "aggregator").mkdir(parents=True)
    (tmp_path / "fleet" / "bi-seed0" / "aggregator" / "rounds.jsonl").write_text("")
    assert main(["report", str(tmp_path / "fleet" / "bi-seed0")]) == 2
    err = one_line_error(capsys)
    assert "is neither a run directory" in err
    assert f"it holds one: edgefcl report {tmp_path}/fleet/bi-seed0/aggregator" in err
    assert main(["report", str(tmp_path / "fleet" / "bi-seed0" / "aggregator")]) == 0


def test_printed_plus_minus_is_the_sample_std():
    from edgefcl.outcomes.metrics import CommStats, sample_std
    from edgefcl.outcomes.report import compare_table, summarize
    from edgefcl.outcomes.results import RunResult

    assert sample_std([1.0, 3.0]) == pytest.approx(math.sqrt(2.0))
    assert sample_std([5.0]) is None  # undefined for one value: no "± 0.0"

    def run(a: float) -> RunResult:  # one client, one task: A = a
        return RunResult("m", 0, np.array([[[a]]]), 1, CommStats(), "", {}, 1.0)

    s = summarize([run(0.2), run(0.4), run(0.9)])["m"]
    assert s["accuracy_std"] == pytest.approx(float(np.std([20.0, 40.0, 90.0], ddof=1)))
    one = summarize([run(0.2)])
    assert one["m"]["accuracy_std"] is None
    assert compare_table(one).splitlines()[1].split()[:3] == ["m", "1", "20.0"]
    assert "±" not in compare_table(one).splitlines()[1]


def test_unseen_tasks_are_blank():
    from edgefcl.outcomes.report import _seen

    m = _seen(np.arange(9.0).reshape(3, 3))
    assert np.isnan(m[0, 1]) and np.isnan(m[0, 2]) and np.isnan(m[1, 2])
    assert m[2, 0] == 6.0 and m[1, 1] == 4.0


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_is_plain_lines_when_redirected():
    from edgefcl.runner import progress_reporter

    out = _Pipe()
    report = progress_reporter("bi seed 0", out, every_s=0.0)
    for done in range(1, 4):
        report(done, 3, "rounds 1")
    report.close()
    text = out.getvalue()
    assert "\r" not in text and "bi seed 0: 3/3 batches (100 %), rounds 1" in text
    quiet = _Pipe()
    report = progress_reporter("x", quiet, every_s=3600.0)
    report(1, 3, "")
    assert quiet.getvalue() == ""  # at most one line per period


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_progress_counts_the_fleets_mini_batches_in_both_modes(mode):
    from edgefcl.config import RunConfig, apply
    from edgefcl.sim.runs import simulate

    cfg = apply(RunConfig(), {"data": {"tasks": 2}, "learn": {"memory_size": 20,
                                                              "local_epochs": 1},
                              "fed": {"clients": 2, "burn_in": 2, "jump": 2, "mode": mode}})
    calls: list[tuple[int, int]] = []
    result = simulate(cfg, progress=lambda done, total, _: calls.append((done, total)))
    batches = result.extra["batches"]
    assert calls[-1] == (batches, batches)  # both clients' mini-batches, as over MQTT
    assert all(a <= b for (a, _), (b, _) in zip(calls, calls[1:], strict=False))


def test_string_labels_travel_with_the_model_to_predict(tmp_path, capsys):
    rng = np.random.default_rng(0)
    names = np.array(["cat", "dog", "emu", "fox"])
    x = rng.normal(size=(400, 6)).astype(np.float32)
    y = names[rng.integers(0, 4, 400)]
    x += (np.searchsorted(np.sort(names), y)[:, None] * 2.0).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "run"
    assert main(["simulate", "--dataset", f"npz:{tmp_path / 'd.npz'}", "--tasks", "2",
                 "--clients", "2", "--memory-size", "20", "--local-epochs", "1", "--burn-in",
                 "2", "--jump", "2", "--quiet", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["labels"] == list(names)
    assert main(["export", "--run", str(out)]) == 0
    np.save(tmp_path / "x.npy", x[:50])
    capsys.readouterr()
    assert main(["predict", "--model", str(out / "model.onnx"), "--input",
                 str(tmp_path / "x.npy")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("predicted classes: ") and any(n in line for n in names)
    assert all(part.split(": ")[0] in names for part in line[19:].split(", "))


def test_a_fleet_that_never_federated_ends_with_a_warning(tmp_path, capsys):
    assert main(["simulate", *SMALL, "--min-clients", "3"]) == 0  # 2 clients: never a round
    err = capsys.readouterr().err
    assert "never federated (rounds = 0)" in err


def test_a_state_dir_without_room_is_one_line_at_start(tmp_path, capsys, monkeypatch):
    # a deployer helper's report: a full --state-dir ended in an sqlite3 traceback
    import sqlite3

    from edgefcl.runtime.aggregator_daemon import AggregatorDaemon

    def full(self, *a, **k):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(AggregatorDaemon, "_save_state", full)
    assert main(["aggregator", "--state-dir", str(tmp_path / "s"), "--broker",
                 "mqtt://127.0.0.1:9", "--connect-timeout", "0.5", "--clients", "1",
                 "--tasks", "1"]) == 2
    err = one_line_error(capsys)
    assert f"cannot write the state in {tmp_path / 's'} (database or disk is full)" in err


def test_a_device_whose_username_is_not_its_id_is_told(capsys):
    # a deployer helper's report: with the broker README's naming (user device-0001) the
    # device's id stayed c000, the ACL dropped its updates and nothing said why
    assert main(["client", "--index", "0", "--username", "device-0001", "--broker",
                 "mqtt://127.0.0.1:9", "--connect-timeout", "0.5", "--clients", "1",
                 "--tasks", "1"]) == 2
    err = capsys.readouterr().err
    assert "--username device-0001 is not this device's id c000" in err
    assert "give it --id device-0001" in err


def test_an_async_runs_table_says_how_its_rounds_went(tmp_path, capsys):
    # a researcher's report: `edgefcl report` on an async run showed only A, F, rounds, bytes
    assert main(["simulate", *SMALL, "--mode", "async", "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "async: " in out and "updates a round, staleness" in out
