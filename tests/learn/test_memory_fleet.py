"""Several memories' choices made as one computation (learn/memory_fleet.py): every memory
keeps what it keeps alone, bit for bit, with one host read for all of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefcl.bench.device_waits import counting
from edgefcl.data.types import DataError
from edgefcl.learn.memory import ReplayMemory, Scoring
from edgefcl.learn.memory_balanced import BalancedRandomMemory
from edgefcl.learn.memory_fleet import choose_together
from edgefcl.learn.memory_scored import BalancedScoreMemory
from edgefcl.learn.selection import SELECTIONS


def features(x: torch.Tensor) -> torch.Tensor:
    return x[:, :4]


def scores(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1).sin()  # candidates' scores from their values: the same in both runs


def memories(rules: list[str]) -> list[ReplayMemory]:
    """One memory per rule (None: class-balanced random), capacities and seeds differing."""
    out: list[ReplayMemory] = []
    for i, rule in enumerate(rules):
        if rule == "cbr":
            out.append(BalancedRandomMemory(30 + 7 * i, (6,), seed=i))
        else:
            out.append(BalancedScoreMemory(30 + 7 * i, (6,), rule, seed=i,
                                           rank_past=bool(i % 2)))
    return out


def stream(i: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Memory i's batches: 3 tasks of 3 classes, batches of 10 (the last of a task shorter)."""
    gen = torch.Generator().manual_seed(100 + i)
    out = []
    for k in range(steps):
        task = k * 3 // steps
        n = 7 if k % 9 == 8 else 10
        y = torch.randint(0, 3, (n,), generator=gen) + 3 * task
        out.append((torch.randn(n, 6, generator=gen), y, task))
    return out


def run(rules: list[str], together: bool, steps: int = 45) -> list[ReplayMemory]:
    mems = memories(rules)
    streams = [stream(i, steps) for i in range(len(mems))]
    for k in range(steps):
        for m, s in zip(mems, streams, strict=True):
            x, y, task = s[k]
            m.update(x, y, task, Scoring(scores, k // 5, features), defer=together)
        if together:
            choose_together([r for m in mems if (r := m.take_deferred()) is not None])
    return mems


RULES = [["cbr", "step", "bottom", "cbr"], sorted(SELECTIONS), ["random", "mix", "mix"]]


@pytest.mark.parametrize("rules", RULES, ids=["mixed", "every-rule", "drawing-rules"])
def test_every_memory_keeps_what_it_keeps_alone(rules: list[str]) -> None:
    alone, together = run(rules, False), run(rules, True)
    for a, b in zip(alone, together, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        for key in ("x", "y", "task", "score", "score_version", "generator"):
            assert torch.equal(sa[key], sb[key]), key
        assert sa["size"] == sb["size"] == a.capacity


def test_one_host_read_for_every_memory() -> None:
    # the kept masks and the check of the new scores for NaN: two reads per memory alone
    mems = memories(["step", "cbr", "bottom", "random"])
    fill = [stream(i, 12) for i in range(len(mems))]
    for k in range(12):  # full memories from here on
        for m, s in zip(mems, fill, strict=True):
            x, y, task = s[k]
            m.update(x, y, task, Scoring(scores, 0, features))
    ahead = []
    for m, s in zip(mems, fill, strict=True):  # scored ahead, as the trainer does
        x, y, _ = s[-1]
        cands = m.pending_scores(x, y, 0, 1, np.asarray(y))
        ahead.append(None if cands is None else scores(cands))
    assert sum(a is not None for a in ahead) >= 2
    with counting() as reads:
        deferred = []
        for m, s, a in zip(mems, fill, ahead, strict=True):
            x, y, _ = s[-1]
            m.update(x, y, 0, Scoring(scores, 1, features, a), np.asarray(y), defer=True)
            r = m.take_deferred()
            assert r is not None
            deferred.append(r)
        choose_together(deferred)
    assert sum(n for site, n in reads.items() if "memory" in site) == 1, reads


def test_nan_scores_fail_the_fleets_choice_before_any_memory_keeps_them() -> None:
    mems = memories(["step", "bottom"])
    fill = [stream(i, 12) for i in range(len(mems))]
    for k in range(12):
        for m, s in zip(mems, fill, strict=True):
            m.update(s[k][0], s[k][1], s[k][2], Scoring(scores, 0, features))
    before = [m.state_dict() for m in mems]
    def nan(t: torch.Tensor) -> torch.Tensor:
        return torch.full((len(t),), float("nan"))

    for m, s, scorer in zip(mems, fill, [scores, nan], strict=True):
        x, y, _ = s[-1]
        m.update(x, y, 0, Scoring(scorer, 1, features), defer=True)
    with pytest.raises(DataError, match="NaN"):
        choose_together([m.take_deferred() for m in mems])  # type: ignore[misc]
    for m, b in zip(mems, before, strict=True):
        assert torch.equal(m.state_dict()["score"], b["score"])


def test_a_deferred_update_must_be_chosen_before_the_memory_is_used() -> None:
    (mem,) = memories(["cbr"])
    *fill, (x, y, task) = stream(0, 6)
    for b in fill:
        mem.update(*b)
    mem.update(x, y, task, defer=True)
    assert mem.deferred is not None
    with pytest.raises(RuntimeError, match="deferred"):
        mem.sample(4)
    with pytest.raises(RuntimeError, match="deferred"):
        mem.update(*stream(0, 1)[0][:2], 0)
