"""Configuration rules: apply/validate reject bad values with one-line ConfigErrors, and the CLI
turns them into one line on stderr with exit status 2 (no traceback)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from edgefcl.config import ConfigError, FedConfig, RunConfig, apply, load_toml, validate
from edgefcl.federation.registry import ENCODINGS
from edgefcl.federation.rules import DENSE_RULES
from edgefcl.learn.methods import MEMORIES, METHODS, SCORES, Method, load


def _checked(values: dict) -> RunConfig:
    cfg = apply(RunConfig(), values)
    validate(cfg)
    return cfg


def test_defaults_are_valid() -> None:
    validate(RunConfig())


@pytest.mark.parametrize("values, message", [
    ({"learn": {"method": "nope"}}, "unknown method 'nope'; choose from"),
    ({"learn": {"nope": 1}}, "unknown key 'nope'"),
    ({"learn": {"memory_sise": 100}}, "unknown key 'memory_sise' in [learn]; did you mean "
     "'memory_size'?"),
    ({"learn": "x"}, "[learn] must be a table"),
    ({"fed": {"encoding": "dense", "aggregation": "conflation"}}, "needs --encoding gaussian"),
    ({"fed": {"encoding": "sparse", "aggregation": "median"}},
     "unknown aggregation 'median' for encoding 'sparse' (it needs --encoding dense or q8); "
     "choose from fedavg"),
    ({"learn": {"method": "apc"}, "fed": {"encoding": "dense"}, "compare": "apc+dense"},
     "method apc needs --encoding apc"),
    ({"compare": "bi+apc"}, "encoding apc needs method apc"),
    ({"fed": {"encoding": "gaussian", "downlink": "sparse"}},
     "downlink sparse works with the dense, sparse, apc, q8 encodings"),
    ({"learn": {"score_source": "posterior"}}, "needs a Bayesian model: use --encoding gaussian"),
    ({"learn": {"method": "vfcl"}, "compare": "vfcl+dense"}, "method vfcl needs --encoding "
     "gaussian"),
    ({"fed": {"encoding": "q9"}}, "unknown encoding 'q9'; choose from " + ", ".join(ENCODINGS)),
    ({"data": {"tasks": 0}}, "tasks must be >= 1"),
    ({"data": {"dataset": "mnist"}}, "dataset 'mnist' is unknown; valid forms: digits, "
     "mnist1d, npz:PATH"),
    ({"data": {"dataset": "npz"}}, "dataset 'npz': use npz:PATH"),
    ({"learn": {"compile_step": "yes"}}, "compile_step must be auto, on or off"),
])
def test_bad_values_are_one_line_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _checked(values)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_options_a_run_would_ignore_are_refused() -> None:
    with pytest.raises(ConfigError, match="^profile heterogeneous needs mode async"):
        _checked({"profile": "heterogeneous"})  # lock-step has no timing to draw
    _checked({"profile": "heterogeneous", "fed": {"mode": "async"}})
    # a researcher's report: an MQTT run recorded the profile it never drew its timing from
    with pytest.raises(ConfigError, match="in-process virtual clock; a run over --transport"):
        _checked({"profile": "heterogeneous", "fed": {"mode": "async"}, "transport": "mqtt"})
    # and the Python API took a profile it then failed on with a traceback
    for profile in ("nope", "trace", "trace:", "heterogeneous:3"):
        with pytest.raises(ConfigError, match=f"^unknown timing profile '{profile}'"):
            RunConfig(fed=FedConfig(mode="async"), profile=profile)


def test_method_beside_compare_is_refused_on_the_command_line() -> None:
    out = _cli("simulate", "--method", "er", "--compare", "bi")
    assert out.returncode == 2 and out.stderr.strip() == (
        "edgefcl: error: --method er and --compare bi: give one (--compare runs each method "
        "it names)")


@pytest.mark.parametrize("values, message", [
    ({"seed": -1}, "seed must be >= 0"),
    ({"data": {"mnist1d_samples": 0}}, "mnist1d_samples must be >= 10"),
    ({"learn": {"hidden": 0}}, "hidden must be >= 1"),
    ({"learn": {"lr": 0.0}}, "lr must be > 0"),
    ({"learn": {"lr": float("inf")}}, "lr must be a finite number"),
    ({"learn": {"noise_std": -0.1}}, "noise_std must be >= 0"),
    ({"learn": {"fedprox_mu": -1.0}}, "fedprox_mu must be >= 0"),
    ({"learn": {"threads": 0}}, "threads must be >= 1"),
    ({"fed": {"round_timeout": -1.0}}, "round_timeout must be >= 0"),
    ({"fed": {"max_staleness": -1}}, "max_staleness must be >= 0"),
    ({"fed": {"staleness_b": -3.0}}, "staleness_b must be >= 0"),  # (it named staleness_a too)
    ({"fed": {"mix": float("nan")}}, "mix must be a finite number"),
    ({"mqtt": {"max_payload": -1}}, "max_payload must be >= 0"),
    ({"mqtt": {"connect_timeout": 0.0}}, "connect_timeout must be > 0"),
])
def test_numbers_that_cannot_work_are_refused(values: dict, message: str) -> None:
    """Each of these once reached the run: a traceback deep in torch or numpy, or a run that
    trained nothing (lr 0) and said nothing."""
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        _checked(values)


def test_a_bad_config_file_is_named_in_its_error(tmp_path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("[learn]\nmemory_sise = 100\n")
    with pytest.raises(ConfigError, match=f"^{path}: unknown key 'memory_sise' in \\[learn\\]"):
        load_toml(path)


def test_unknown_method_lists_every_method() -> None:
    with pytest.raises(ConfigError) as err:
        _checked({"learn": {"method": "nope"}})
    assert all(m in str(err.value) for m in METHODS)


def test_bayes_method_implies_gaussian_encoding() -> None:
    cfg = _checked({"learn": {"method": "vfcl"}})
    assert (cfg.fed.encoding, cfg.fed.aggregation) == ("gaussian", "conflation")
    cfg = _checked({"learn": {"method": "fedbnn"}})
    assert (cfg.fed.encoding, cfg.fed.aggregation) == ("gaussian", "fedbnn")


def test_every_score_is_a_method_ranked_by_it() -> None:
    for name in SCORES:
        assert METHODS[name] == Method(name, "balanced-score", score=name,
                                       help=METHODS[name].help)
        assert callable(load(SCORES[name].fn))
    for m in METHODS.values():
        assert m.memory in (None, *MEMORIES) and m.score in SCORES
        assert not m.hooks or callable(load(m.hooks))


def test_names_come_from_the_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name added to a registry is valid at once, and the errors list it (no second list)."""
    monkeypatch.setitem(METHODS, "mine", Method("mine", None))
    _checked({"learn": {"method": "mine"}})
    monkeypatch.setitem(DENSE_RULES, "mine", DENSE_RULES["fedavg"])
    _checked({"fed": {"aggregation": "mine"}})
    with pytest.raises(ConfigError, match="choose from .*mine"):
        _checked({"fed": {"aggregation": "nope"}})
    for enc in ENCODINGS.values():  # every encoding's default rule is one of its rules
        assert enc.default_rule in enc.rules


def test_pairings_come_from_the_registered_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a method or an encoding allows is a field of its registry entry, not a name
    compared elsewhere: the head `auto` gives, the value dtypes an encoding sends."""
    from edgefcl.config import resolve_head

    assert resolve_head("auto", "fedbnn") == "prototypes" and resolve_head("auto", "bi") == "fixed"
    monkeypatch.setitem(METHODS, "mine", Method("mine", None, head="prototypes"))
    assert resolve_head("auto", "mine") == "prototypes"
    with pytest.raises(ConfigError, match="value_dtype bfloat16 does not work with the apc"):
        _checked({"learn": {"method": "apc"}, "fed": {"value_dtype": "bfloat16"}})
    _checked({"fed": {"encoding": "sparse", "value_dtype": "bfloat16"}})


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
    (("--encoding", "nope"), "unknown encoding 'nope'; choose from " + ", ".join(ENCODINGS)),
    (("--aggregation", "nope"), "unknown aggregation 'nope' for encoding 'dense'; choose from "
     + ", ".join(DENSE_RULES)),
    (("--aggregation", "foo"), "unknown aggregation 'foo'"),
    (("--encoding", "q8", "--aggregation", "conflation"), "unknown aggregation 'conflation' for "
     "encoding 'q8' (it needs --encoding gaussian)"),
    (("--method", "apc", "--encoding", "sparse"), "method apc needs --encoding apc"),
])
def test_cli_unknown_encoding_or_aggregation_exits_2(args: tuple[str, ...], message: str) -> None:
    out = _cli("simulate", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr and out.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("args, message", [
    (("--memory-size", "-1"), "--memory-size must be >= 0"),
    (("--threads", "0"), "--threads must be >= 1"),
    (("--seed", "-5"), "--seed must be >= 0"),
])
def test_cli_errors_name_the_flag_given(args: tuple[str, ...], message: str) -> None:
    out = _cli("simulate", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"edgefcl: error: {message}"


def test_cli_errors_name_the_config_file_field(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[learn]\nmemory_size = -1\n")
    out = _cli("simulate", "--config", str(path))
    assert out.returncode == 2
    assert out.stderr.strip() == f"edgefcl: error: {path}: memory_size in [learn] must be >= 0"


@pytest.mark.parametrize("url", ["127.0.0.1:1883", "http://127.0.0.1", "mqtt://:1883",
                                 "mqtt://127.0.0.1:notaport", "mqtt://127.0.0.1:99999",
                                 "mqtt://127.0.0.1:0"])
def test_a_broker_url_that_cannot_work_is_refused_when_built(url) -> None:
    # a deployer helper's report: a port that is no number ended in a ValueError traceback
    with pytest.raises(ConfigError, match="broker must look like mqtt://HOST:PORT"):
        _checked({"mqtt": {"broker": url}})


def test_broker_urls_that_work() -> None:
    for url in ("mqtt://127.0.0.1", "mqtts://broker.example:8883", "MQTT://h:1"):
        _checked({"mqtt": {"broker": url}})
