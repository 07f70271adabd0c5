"""Configuration rules: apply/validate reject bad values with one-line ConfigErrors, and the CLI
turns them into one line on stderr with exit status 2 (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgefcl.config import METHODS, ConfigError, RunConfig, apply, validate


def _checked(values: dict) -> RunConfig:
    cfg = apply(RunConfig(), values)
    validate(cfg)
    return cfg


def test_defaults_are_valid() -> None:
    validate(RunConfig())


@pytest.mark.parametrize("values, message", [
    ({"learn": {"method": "nope"}}, "unknown method 'nope'; choose from"),
    ({"learn": {"nope": 1}}, "unknown key 'nope'"),
    ({"learn": "x"}, "[learn] must be a table"),
    ({"fed": {"encoding": "dense", "aggregation": "conflation"}}, "needs --encoding gaussian"),
    ({"fed": {"encoding": "sparse", "aggregation": "median"}}, "aggregates with fedavg only"),
    ({"learn": {"method": "apc"}, "fed": {"encoding": "dense"}, "compare": "apc+dense"},
     "go together"),
    ({"data": {"tasks": 0}}, "tasks must be >= 1"),
])
def test_bad_values_are_one_line_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _checked(values)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_method_lists_every_method() -> None:
    with pytest.raises(ConfigError) as err:
        _checked({"learn": {"method": "nope"}})
    assert all(m in str(err.value) for m in METHODS)


def test_bayes_method_implies_gaussian_encoding() -> None:
    _checked({"learn": {"method": "vfcl"}})


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "edgefcl", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_unknown_method_exits_2_with_one_line() -> None:
    out = _cli("simulate", "--method", "nope")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "unknown method 'nope'" in out.stderr


@pytest.mark.parametrize("args, message", [
    (("--encoding", "nope"), "unknown encoding 'nope'; choose from apc, dense, gaussian, sparse"),
    (("--aggregation", "nope"), "unknown aggregation 'nope' for encoding 'dense'; choose from"),
])
def test_cli_unknown_encoding_or_aggregation_exits_2(args: tuple[str, ...], message: str) -> None:
    out = _cli("simulate", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr and out.stderr.strip().count("\n") == 0
