"""The Python API: `edgefcl.Learner` (river's interface), `edgefcl.simulate`, and configs that
check themselves on construction with the CLI's messages."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import edgefcl
from edgefcl.cli import main


def digits(classes: tuple[int, ...], n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    keep = np.flatnonzero(np.isin(y, classes))[:n]
    return (X[keep] / 16).astype(np.float32), y[keep]


def test_learner_learns_a_task_and_predicts_its_labels() -> None:
    X, y = digits((0, 1), 120)
    learner = edgefcl.Learner(classes=10, learn=edgefcl.LearnConfig(memory_size=40))
    for i in range(0, 100, 10):
        learner.learn_many(X[i:i + 10], y[i:i + 10], task=0)
    pred = learner.predict_many(X[100:])
    assert pred.dtype.kind == "i" and (pred == y[100:]).mean() >= 0.9
    proba = learner.predict_proba_many(X[100:])
    assert proba.shape == (20, 10) and np.allclose(proba.sum(1), 1, atol=1e-5)
    assert learner.labels == list(range(10))
    assert learner.predict_one(X[100]) == pred[0]


def test_task_boundaries_are_explicit_and_stay_until_changed() -> None:
    X, y = digits((0, 1, 2, 3))
    learner = edgefcl.Learner(classes=4)
    learner.learn_many(X[:10], y[:10], task=0)
    learner.learn_many(X[10:20], y[10:20])  # no task: the last one
    inner = learner.client.learner
    assert inner.task == 0 and inner.batch_in_task == 2
    learner.learn_many(X[20:30], y[20:30], task=1)
    assert inner.task == 1 and inner.batch_in_task == 1 and learner.task == 1


def test_same_seed_same_predictions() -> None:
    X, y = digits((0, 1, 2))

    def run() -> np.ndarray:
        learner = edgefcl.Learner(classes=3, seed=3)
        for i in range(0, 50, 10):
            learner.learn_many(X[i:i + 10], y[i:i + 10])
        return learner.predict_proba_many(X[50:])

    assert np.array_equal(run(), run())


def test_learn_one_is_a_batch_of_one() -> None:
    X, y = digits((0, 1))
    learner = edgefcl.Learner(classes=2)
    learner.learn_one(X[0], y[0])
    assert learner.client.learner.batches == 1 and learner.client.learner.samples_in_task == 1


def test_open_label_space_returns_the_labels_as_given() -> None:
    X, y = digits((0, 1, 2), 90)
    names = np.array(["zero", "one", "two"])[y]
    learner = edgefcl.Learner()  # no classes: the prototype library
    for i in range(0, 60, 10):
        learner.learn_many(X[i:i + 10], names[i:i + 10])
    assert sorted(learner.labels) == ["one", "two", "zero"]
    assert set(learner.predict_many(X[60:]).tolist()) <= {"zero", "one", "two"}
    ints = edgefcl.Learner()
    ints.learn_many(X[:10], y[:10])
    assert all(isinstance(v, int) for v in ints.labels)


@pytest.mark.parametrize("call,message", [
    (lambda L, X: L.predict_many(X), "call learn_many first"),
    (lambda L, X: L.learn_many(X, np.full(len(X), 7)), "labels must be integers in 0..2"),
    (lambda L, X: L.learn_many(X, np.zeros(3, int)), "one label per sample"),
    (lambda L, X: L.learn_many(X[0], np.zeros(1, int)), "batch of samples"),
    (lambda L, X: (L.learn_many(X, np.zeros(len(X), int)), L.predict_many(X[:, :9])),
     r"X's samples have shape \(9,\); this learner was built for \(64,\)"),
    (lambda L, X: (L.learn_many(X, np.zeros(len(X), int)), L.learn_many(X[:, :9], [0] * 10)),
     "built for"),  # torch said "mat1 and mat2 shapes cannot be multiplied"
])
def test_bad_input_is_a_clear_error(call, message) -> None:
    X, _ = digits((0,), 10)
    with pytest.raises(ValueError, match=message):
        call(edgefcl.Learner(classes=3), X)


def test_simulate_returns_the_results_object() -> None:
    cfg = edgefcl.RunConfig(data=edgefcl.DataConfig(tasks=2), learn=edgefcl.LearnConfig(
        memory_size=30, local_epochs=1), fed=edgefcl.FedConfig(clients=2))
    run = edgefcl.simulate(cfg)
    assert isinstance(run, edgefcl.RunResult)
    assert run.acc.shape == (2, 2, 2) and 0 <= run.accuracy <= 100 and run.rounds > 0


def test_a_sweep_is_sweep_and_simulate_refuses_one() -> None:
    """`simulate` of a config with --compare or several seeds ran bi seed 0 alone, silently."""
    cfg = edgefcl.RunConfig(data=edgefcl.DataConfig(tasks=2, classes_per_task=2),
                            learn=edgefcl.LearnConfig(memory_size=20, local_epochs=1),
                            fed=edgefcl.FedConfig(clients=2, burn_in=2, jump=2),
                            compare="er,fedavg", seeds=2, quiet=True)
    with pytest.raises(edgefcl.ConfigError, match="edgefcl.sweep"):
        edgefcl.simulate(cfg)
    runs = edgefcl.sweep(cfg)
    assert [(r.method, r.seed) for r in runs] == [("er", 0), ("er", 1), ("fedavg", 0),
                                                  ("fedavg", 1)]


def test_out_writes_what_the_cli_writes(tmp_path) -> None:
    # a researcher's (a reviewer helper's): sweep(RunConfig(..., out=DIR)) wrote nothing
    small = {"data": edgefcl.DataConfig(tasks=2, classes_per_task=2),
             "learn": edgefcl.LearnConfig(memory_size=20, local_epochs=1),
             "fed": edgefcl.FedConfig(clients=2, burn_in=2, jump=2), "quiet": True}
    edgefcl.sweep(edgefcl.RunConfig(**small, compare="er,fedavg", out=str(tmp_path / "s")))
    for path in ("results.json", "comparison.png", "er/seed0/results.json",
                 "fedavg/seed0/config.toml"):
        assert (tmp_path / "s" / path).is_file(), path
    edgefcl.simulate(edgefcl.RunConfig(**small, out=str(tmp_path / "one")))
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("results.json", "config.toml", "global.npz"):  # as a plot: by the umask
        assert (tmp_path / "one" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_a_sweep_runs_apc_beside_methods_of_other_encodings() -> None:
    # a researcher's (a reviewer helper's): --compare er,apc ran er, then stopped with
    # "encoding apc needs method apc": each run's config was checked with every entry
    cfg = edgefcl.RunConfig(data=edgefcl.DataConfig(tasks=2, classes_per_task=2),
                            learn=edgefcl.LearnConfig(memory_size=20, local_epochs=1),
                            fed=edgefcl.FedConfig(clients=2, burn_in=2, jump=2),
                            compare="er,apc,vfcl", quiet=True)
    runs = edgefcl.sweep(cfg)
    assert [r.method for r in runs] == ["er", "apc", "vfcl"]
    assert list(edgefcl.summarize(runs)) == ["er", "apc", "vfcl"]
    assert [r.config["fed"]["encoding"] for r in runs] == ["dense", "apc", "gaussian"]


@pytest.mark.parametrize("build,flags", [
    (lambda: edgefcl.LearnConfig(memory_size=-3), ["--memory-size", "-3"]),
    (lambda: edgefcl.FedConfig(jump=0), ["--jump", "0"]),
    (lambda: edgefcl.DataConfig(batch_size=0), ["--batch-size", "0"]),
    (lambda: edgefcl.MqttConfig(chunk_size=10), ["--chunk-size", "10"]),
    (lambda: edgefcl.RunConfig(learn=edgefcl.LearnConfig(method="nope")), ["--method", "nope"]),
])
def test_configs_fail_on_construction_with_the_clis_message(build, flags, capsys) -> None:
    with pytest.raises(edgefcl.ConfigError) as e:
        build()
    assert main(["simulate", *flags]) == 2
    name = e.value.field.partition(".")[2]  # the CLI names the flag it was given
    expected = flags[0] + str(e.value)[len(name):] if name else str(e.value)
    assert capsys.readouterr().err.strip() == f"edgefcl: error: {expected}"


@given(st.integers(-1000, 1000))
def test_memory_size_is_refused_exactly_when_negative(n: int) -> None:
    if n < 0:
        with pytest.raises(edgefcl.ConfigError, match="memory_size must be >= 0"):
            edgefcl.LearnConfig(memory_size=n)
    else:
        assert edgefcl.LearnConfig(memory_size=n).memory_size == n


@given(st.floats(-2, 3, allow_nan=False))
def test_mix_is_refused_exactly_outside_0_1(mix: float) -> None:
    if 0 <= mix <= 1:
        assert edgefcl.FedConfig(mix=mix).mix == mix
    else:
        with pytest.raises(edgefcl.ConfigError, match="mix must be in"):
            edgefcl.FedConfig(mix=mix)


def test_import_edgefcl_is_light() -> None:
    import subprocess
    import sys

    code = ("import sys, edgefcl; edgefcl.LearnConfig(); "
            "print(sorted(m for m in ('torch', 'sklearn', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_example_runs() -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "learner.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("after task 5:") and last.count("T") == 5
