"""The lock-step simulator with its clients' steps stacked (`--batch-clients on`)."""

from __future__ import annotations

import numpy as np

from edgefcl.config import RunConfig, apply
from edgefcl.sim.runs import simulate


def test_stacked_clients_run_the_same_schedule_and_learn_alike():
    values = {"data": {"tasks": 2, "classes_per_task": 2},
              "learn": {"memory_size": 40, "local_epochs": 2},
              "fed": {"clients": 3, "burn_in": 2, "jump": 2}, "quiet": True}
    runs = {mode: simulate(apply(RunConfig(), {**values, "learn": {**values["learn"],
                                                                    "batch_clients": mode}}))
            for mode in ("off", "on")}
    off, on = runs["off"], runs["on"]
    # all but the ticks where a client's shapes differ from the others' (a last, short batch)
    assert 0.9 * on.extra["batches"] <= on.extra["stacked_steps"] <= on.extra["batches"]
    assert "stacked_steps" not in off.extra
    assert on.rounds == off.rounds and on.extra["batches"] == off.extra["batches"]
    # float-order differences only: the same draws, the same schedule, close accuracies
    assert np.abs(on.acc - off.acc).max() < 0.1, (on.acc, off.acc)


def test_a_method_that_cannot_be_stacked_falls_back_and_says_so(caplog):
    cfg = apply(RunConfig(), {"data": {"tasks": 1, "classes_per_task": 2},
                              "learn": {"method": "fedprox", "memory_size": 20,
                                        "local_epochs": 1, "batch_clients": "on"},
                              "fed": {"clients": 2, "burn_in": 2, "jump": 2}, "quiet": True})
    with caplog.at_level("WARNING", logger="edgefcl.sim.lockstep"):
        result = simulate(cfg)
    assert result.extra["stacked_steps"] == 0 and result.rounds > 0
    assert "method fedprox adds a loss term" in caplog.text
