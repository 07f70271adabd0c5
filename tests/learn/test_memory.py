"""Tests for the replay memory (edgefcl.learn.memory and its policies: memory_reservoir,
memory_balanced, memory_scored; the registry memory_policies).

Samples are 2-d vectors x = (id, label): ids are unique per stream so the tests can tell which
samples were kept, and a scorer that returns x[:, 0] gives every sample a known score.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.bench.device_waits import counting
from edgefcl.config import ConfigError
from edgefcl.data.types import DataError
from edgefcl.learn.memory import (
    ClassBalanced,
    Grouping,
    ReplayMemory,
    Scoring,
    stream_paced,
    water_fill,
)
from edgefcl.learn.memory_balanced import BalancedRandomMemory
from edgefcl.learn.memory_policies import POLICIES, MemoryPolicy, get_policy
from edgefcl.learn.memory_reservoir import ReservoirMemory
from edgefcl.learn.memory_scored import BalancedScoreMemory
from edgefcl.learn.methods import load
from edgefcl.learn.selection import get_selection


def batch(ids, label: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(ids, dtype=torch.float32)
    x = torch.stack([ids, torch.full_like(ids, float(label))], dim=1)
    return x, torch.full((ids.numel(),), label, dtype=torch.int64)


def id_score(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0].clone()


class Recorder:
    """A scorer (score = id) that records the ids of every call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(sorted(x[:, 0].long().tolist()))
        return x[:, 0].clone()


def memory_class(policy: str) -> type[ReplayMemory]:
    """The memory class the registry names for `policy`."""
    return load(get_policy(policy).memory)


def ids_of(mem: ReplayMemory, label: int | None = None) -> set[int]:
    keep = mem.y[: mem.size] == label if label is not None else slice(None)
    return set(mem.x[: mem.size][keep][:, 0].long().tolist())


# ---------------------------------------------------------------- water-filling


@pytest.mark.parametrize(
    ("counts", "prio", "cap", "expected"),
    [
        ([8, 2, 3], [0.1, 0.2, 0.3], 10, [5, 2, 3]),  # q = 5: classes 1, 2 keep all
        ([5, 5, 1], [0.2, 0.1, 0.5], 10, [4, 5, 1]),  # q = 4, leftover 1 to class 1
        ([3, 3, 3], [0.3, 0.1, 0.2], 2, [0, 1, 1]),  # q = 0, 2 leftovers by priority
        ([6, 6, 6], [0.5, 0.4, 0.6], 10, [3, 4, 3]),  # all over: quota = 10 // 3
        ([1, 9], [0.0, 0.0], 4, [1, 3]),
    ],
)
def test_water_fill_hand_computed(counts, prio, cap, expected):
    got = water_fill(np.array(counts), np.array(prio, dtype=np.float32), cap)
    assert got.tolist() == expected


def _reference_q(counts: list[int], cap: int) -> int:
    q = 0
    while sum(min(n, q + 1) for n in counts) <= cap:
        q += 1
    return q


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.data())
def test_water_fill_fills_exactly_by_quota_and_priority(counts, data):
    cap = data.draw(st.integers(0, sum(counts) - 1))
    prio = np.array(data.draw(st.permutations(range(len(counts)))), dtype=np.float32)
    keep = water_fill(np.array(counts), prio, cap)
    q = _reference_q(counts, cap)
    assert int(keep.sum()) == cap
    for n, k in zip(counts, keep.tolist(), strict=True):
        assert k == n if n <= q else k in (q, q + 1)
    # the leftover slots go to the over-quota classes of lowest priority
    plus = [p for n, k, p in zip(counts, keep.tolist(), prio.tolist(), strict=True)
            if n > q and k == q + 1]
    rest = [p for n, k, p in zip(counts, keep.tolist(), prio.tolist(), strict=True)
            if n > q and k == q]
    assert not plus or not rest or max(plus) < min(rest)


# ---------------------------------------------------------------- construction and input


def test_bad_configuration_is_rejected():
    with pytest.raises(ConfigError, match="policy"):
        get_policy("fifo")
    with pytest.raises(ConfigError, match="selection"):
        BalancedScoreMemory(10, (2,), selection="middle")
    with pytest.raises(ConfigError, match="capacity"):
        ReservoirMemory(-1, (2,))
    with pytest.raises(ConfigError, match="rescore"):
        BalancedScoreMemory(10, (2,), rescore="sometimes")


def test_bad_batches_are_rejected():
    mem = BalancedScoreMemory(4, (2,))
    x, y = batch([0, 1], 0)
    with pytest.raises(DataError, match="shape"):
        mem.update(torch.zeros(2, 3), y, 0, Scoring(id_score))
    with pytest.raises(DataError, match="labels"):
        mem.update(x, y[:1], 0, Scoring(id_score))
    with pytest.raises(DataError, match="integers"):
        mem.update(x, y.float(), 0, Scoring(id_score))
    with pytest.raises(DataError, match=">= 0"):
        mem.update(x, -y - 1, 0, Scoring(id_score))
    with pytest.raises(ConfigError, match="scorer"):
        mem.update(x, y, 0)
    assert mem.size == 0
    full = BalancedScoreMemory(1, (2,))  # 2 candidates for 1 slot: scores decide
    with pytest.raises(DataError, match="scorer must return"):
        full.update(x, y, 0, Scoring(lambda t: t[:1, 0]))
    with pytest.raises(DataError, match="NaN"):
        full.update(x, y, 0, Scoring(lambda t: torch.full((t.shape[0],), float("nan"))))


def test_zero_capacity_stores_nothing():
    for policy in ("reservoir", "balanced-random", "balanced-score"):
        mem = memory_class(policy)(0, (2,))
        assert mem.update(*batch([0, 1, 2], 0), 0, Scoring(id_score)) == 0
        assert mem.size == 0 and mem.seen == 3
        assert mem.sample(5) is None


def test_x_dtype_is_the_storage_dtype():
    mem = BalancedRandomMemory(4, (2,), x_dtype=torch.float16)
    mem.update(*batch([1.5, 2.5], 0), 0)
    assert mem.x.dtype == torch.float16
    assert mem.x[:2, 0].tolist() == [1.5, 2.5]


# ---------------------------------------------------------------- balanced policies


def test_append_while_room_then_exactly_full():
    mem = BalancedRandomMemory(10, (2,))
    mem.update(*batch(range(0, 4), 0), 0)
    mem.update(*batch(range(4, 8), 1), 0)
    assert mem.size == 8 and mem.class_counts() == {0: 4, 1: 4}
    assert mem.y[:8].tolist() == [0] * 4 + [1] * 4  # appended in order
    mem.update(*batch(range(8, 12), 2), 1)  # 4 + 4 + 4 > 10: q = 3, one leftover
    counts = mem.class_counts()
    assert mem.size == 10 and sum(counts.values()) == 10
    assert sorted(counts.values()) == [3, 3, 4]


def test_under_quota_classes_keep_everything():
    mem = BalancedRandomMemory(10, (2,))
    mem.update(*batch(range(0, 8), 0), 0)
    mem.update(*batch(range(8, 10), 1), 0)
    mem.update(*batch(range(10, 13), 2), 1)  # counts 8, 2, 3 -> q = 5
    assert mem.class_counts() == {0: 5, 1: 2, 2: 3}
    assert ids_of(mem, 1) == {8, 9} and ids_of(mem, 2) == {10, 11, 12}
    assert ids_of(mem, 0) < set(range(8))


def test_leftover_slot_then_rebalance():
    mem = BalancedRandomMemory(10, (2,), seed=3)
    mem.update(*batch(range(0, 5), 0), 0)
    mem.update(*batch(range(5, 10), 1), 0)
    mem.update(*batch([10], 2), 1)  # counts 5, 5, 1: q = 4, one leftover to class 0 or 1
    counts = mem.class_counts()
    assert counts[2] == 1 and sorted([counts[0], counts[1]]) == [4, 5]
    mem.update(*batch([11], 2), 1)  # counts {4, 5}, 2: q = 4, no leftover
    assert mem.class_counts() == {0: 4, 1: 4, 2: 2}


def _past_and_current(cap: int, per_class: int, selection: str, values: list[list[int]]):
    mem = BalancedScoreMemory(cap, (2,), selection=selection, seed=1)
    mem.update(*batch(range(100, 100 + per_class), 0), 0, Scoring(id_score))
    mem.update(*batch(range(200, 200 + per_class), 1), 0, Scoring(id_score))
    for v in values:
        mem.update(*batch(v, 2), 1, Scoring(id_score))
    return mem


def test_bottom_keeps_lowest_scores_and_past_classes_are_cut_to_quota():
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    mem = _past_and_current(6, 3, "bottom", [perm[i : i + 4] for i in range(0, 20, 4)])
    assert mem.class_counts() == {0: 2, 1: 2, 2: 2}
    assert ids_of(mem, 2) == {0, 1}
    assert ids_of(mem, 0) < {100, 101, 102} and ids_of(mem, 1) < {200, 201, 202}


def test_top_keeps_highest_scores():
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(1)).tolist()
    mem = _past_and_current(6, 3, "top", [perm[i : i + 4] for i in range(0, 20, 4)])
    assert ids_of(mem, 2) == {18, 19}
    assert mem.class_counts() == {0: 2, 1: 2, 2: 2}


def test_step_keeps_evenly_spaced_ranks():
    # capacity 12, counts 6, 6, 8 -> quota 4 each; class 2 keeps ranks 0, 2, 4, 6 of 8.
    mem = _past_and_current(12, 6, "step", [[5, 3, 7, 0, 6, 1, 4, 2]])
    assert mem.class_counts() == {0: 4, 1: 4, 2: 4}
    assert ids_of(mem, 2) == {0, 2, 4, 6}
    # 3 of 9 (capacity 9, counts 3, 3, 9 -> quota 3): ranks 0, 3, 6.
    mem = _past_and_current(9, 3, "step", [[8, 7, 6, 5, 4, 3, 2, 1, 0]])
    assert ids_of(mem, 2) == {0, 3, 6}


def test_past_classes_are_random_not_ranked():
    # Past classes hold ids 100..109 / 200..209; a ranked cut (bottom) would keep the lowest.
    kept = set()
    for seed in range(8):
        mem = BalancedScoreMemory(10, (2,), seed=seed)
        mem.update(*batch(range(100, 105), 0), 0, Scoring(id_score))
        mem.update(*batch(range(200, 205), 1), 0, Scoring(id_score))
        mem.update(*batch(range(0, 10), 2), 1, Scoring(id_score))
        kept |= ids_of(mem, 0)
    assert kept == set(range(100, 105))


def test_only_candidates_whose_fate_depends_on_a_score_are_scored():
    mem = BalancedScoreMemory(6, (2,), seed=0)
    rec = Recorder()

    def step(ids, label, task, version=0, rescore="on_change"):
        before = len(rec.calls)
        mem.rescore = rescore
        n = mem.update(*batch(ids, label), task, Scoring(rec, version))
        if n == 0:
            assert len(rec.calls) == before
            return []
        assert len(rec.calls) == before + 1 and n == len(rec.calls[-1])
        return rec.calls[-1]

    # While the memory fills nothing is dropped: no score is needed.
    assert step([0, 1, 2], 0, 0) == []
    assert step([3, 4, 5], 1, 0) == []
    # counts 3, 5 for 6 slots -> allotments 3, 3: only class 1 is over quota and ranked.
    assert step([6, 7], 1, 0) == [3, 4, 5, 6, 7]
    assert ids_of(mem, 1) == {3, 4, 5}  # bottom: the lowest scores
    # class 0 (never scored) is now over quota: all its candidates, class 1 untouched.
    assert step([8, 9], 0, 0, version=1) == [0, 1, 2, 8, 9]
    # class 1's cached scores are from version 0: re-scored under version 1.
    assert step([10, 11], 1, 0, version=1) == [3, 4, 5, 10, 11]
    # same version: only the new samples.
    assert step([14, 15], 1, 0, version=1) == [14, 15]
    # rescore "always" re-scores the ranked class only; class 1 is at its allotment.
    assert step([12, 13], 0, 0, version=1, rescore="always") == [0, 1, 2, 12, 13]
    # New task: counts 3, 3, 3 -> allotments 2 each; past classes are cut at random (no
    # score), the current class 2 is ranked.
    assert step([20, 21, 22], 2, 1, version=1) == [20, 21, 22]
    assert mem.class_counts() == {0: 2, 1: 2, 2: 2}
    kept2 = sorted(ids_of(mem, 2))
    assert step([23, 24], 2, 1, version=2) == sorted(kept2 + [23, 24])
    # Cached scores are the ids (scorer = id) with the version they were computed under.
    s = mem.size
    scored = mem.score_version[:s] >= 0
    assert torch.equal(mem.score[:s][scored], mem.x[:s, 0][scored])
    assert (mem.score_version[:s][mem.task[:s] == 1] == 2).all()


def test_keep_stale_scores_each_sample_once():
    mem = BalancedScoreMemory(4, (2,), seed=0, rescore="never")
    rec = Recorder()
    mem.update(*batch([0, 1, 2, 3], 0), 0, Scoring(rec))
    assert mem.update(*batch([4], 0), 0, Scoring(rec, 1)) == 5
    assert mem.update(*batch([5], 0), 0, Scoring(rec, 2)) == 1
    assert rec.calls == [[0, 1, 2, 3, 4], [5]]


def test_rank_past_ranks_past_classes_by_their_cached_scores():
    # Past classes 0 and 1 were scored while current (ids = scores); under a new task they
    # are cut by the rule on those cached scores (bottom: the lowest ids), never re-scored.
    mem = BalancedScoreMemory(6, (2,), seed=3, rank_past=True)
    rec = Recorder()
    mem.update(*batch([105, 101, 103], 0), 0, Scoring(rec))
    mem.update(*batch([204, 202, 206, 200], 1), 0, Scoring(rec))  # class 1 over quota: scored
    mem.update(*batch([104, 100], 0), 0, Scoring(rec))  # class 0 over quota: scored
    assert ids_of(mem, 0) == {100, 101, 103} and ids_of(mem, 1) == {200, 202, 204}
    calls = len(rec.calls)
    mem.update(*batch([0, 1, 2], 2), 1, Scoring(rec, 5))  # 3+3+3 -> 2 each
    assert rec.calls[calls:] == [[0, 1, 2]]  # cached past scores reused under version 5
    assert ids_of(mem, 0) == {100, 101} and ids_of(mem, 1) == {200, 202}
    assert ids_of(mem, 2) == {0, 1}


def test_pending_scores_are_what_update_scores():
    mem = BalancedScoreMemory(6, (2,), selection="step", seed=0)
    rec = Recorder()
    mem.update(*batch([0, 1, 2], 0), 0, Scoring(rec))
    mem.update(*batch([3, 4, 5], 1), 0, Scoring(rec))
    x, y = batch([6, 7], 1)
    ahead = mem.pending_scores(x, y, 0, 0)
    assert sorted(ahead[:, 0].long().tolist()) == [3, 4, 5, 6, 7]
    assert mem.size == 6 and rec.calls == []  # nothing changed, nothing scored
    twin = BalancedScoreMemory(6, (2,), selection="step", seed=0)
    twin.load_state_dict(mem.state_dict())
    assert mem.update(x, y, 0, Scoring(rec, scores=ahead[:, 0].clone())) == 5
    assert rec.calls == []  # the scores given were used
    assert twin.update(x, y, 0, Scoring(id_score)) == 5
    assert torch.equal(mem.x, twin.x) and torch.equal(mem.score, twin.score)


def test_a_new_label_is_planned_ahead_unless_its_priority_decides():
    def mem(capacity: int) -> ReplayMemory:
        m = BalancedScoreMemory(capacity, (2,), selection="step", seed=0)
        m.update(*batch([0, 1, 2], 0), 0, Scoring(id_score))
        m.update(*batch([3, 4, 5], 1), 0, Scoring(id_score))
        return m

    # 3 + 3 + 3 candidates for 7 slots: q = 2 and one leftover, to the class whose priority
    # (label 9's is drawn in update) ranks first; that class keeps all 3 and needs no score
    assert mem(7).pending_scores(*batch([10, 11, 12], 9), 0, 0) is None
    # 3 + 3 + 1 for 6: label 9 keeps its one sample whatever its priority, the leftover goes
    # to class 0 or 1 by their known priorities, and the other one is ranked
    a, b = mem(6), mem(6)
    x, y = batch([10], 9)
    ahead = a.pending_scores(x, y, 0, 0)
    assert sorted(ahead[:, 0].long().tolist()) in ([0, 1, 2], [3, 4, 5])
    rec = Recorder()
    assert a.update(x, y, 0, Scoring(rec, scores=ahead[:, 0].clone())) == 3 and rec.calls == []
    assert b.update(x, y, 0, Scoring(id_score)) == 3 and _state_equal(a, b)


class CloseToHalf(ClassBalanced):
    """Leftovers to the priorities closest to 0.5: not decided by rank alone."""

    def allot(self, counts: np.ndarray, priority: np.ndarray, capacity: int) -> np.ndarray:
        return water_fill(counts, np.abs(priority - 0.5), capacity)


def test_update_scores_again_when_the_drawn_priority_changes_what_it_needs():
    rescored = 0
    for seed in range(20):
        mems = [BalancedScoreMemory(7, (2,), selection="step", seed=seed,
                             grouping=CloseToHalf()) for _ in range(2)]
        for m in mems:
            m.update(*batch([0, 1, 2], 0), 0, Scoring(id_score))
            m.update(*batch([3, 4, 5], 1), 0, Scoring(id_score))
        x, y = batch([10, 11, 12], 9)
        ahead = mems[0].pending_scores(x, y, 0, 0)  # both ends plan label 9 last
        rec = Recorder()
        scored = mems[0].update(x, y, 0, Scoring(rec, scores=id_score(ahead)))
        rescored += bool(rec.calls)
        assert scored == mems[1].update(x, y, 0, Scoring(id_score)) and _state_equal(*mems)
    assert rescored > 0


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.sampled_from(["equal", "stream"]),
       st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 7), min_size=1,
                                                        max_size=6)), min_size=1, max_size=14))
def test_scores_planned_ahead_are_the_ones_update_needs(capacity, share, batches):
    """Over random streams (labels new and known, tasks coming back), scoring what
    `pending_scores` asks before the update leaves the memory exactly as scoring inside the
    update does, and the update never has to score again (the plan for a new label holds
    whatever priority it draws)."""
    def mem() -> ReplayMemory:
        return BalancedScoreMemory(capacity, (2,), selection="step", seed=3,
                            current_share=share)

    ahead_mem, inside = mem(), mem()
    ids = 0
    for version, (task, labels) in enumerate(batches):
        y = torch.tensor(labels, dtype=torch.int64)
        x = torch.stack([torch.arange(ids, ids + y.numel(), dtype=torch.float32),
                         y.float()], dim=1)
        ids += y.numel()
        version //= 3
        cands = ahead_mem.pending_scores(x, y, task, version)
        rec = Recorder()
        scores = None if cands is None else id_score(cands)
        scored = ahead_mem.update(x, y, task, Scoring(rec, version, scores=scores))
        assert scored == inside.update(x, y, task, Scoring(id_score, version))
        assert cands is None or rec.calls == []
        assert _state_equal(ahead_mem, inside)


def _memory(*fills: tuple[list[int], int, int]) -> ReplayMemory:
    """A step-ranked memory of 6 after the updates (ids, label, version), all of task 0."""
    mem = BalancedScoreMemory(6, (2,), selection="step", seed=0)
    for ids, label, version in fills:
        mem.update(*batch(ids, label), 0, Scoring(id_score, version))
    return mem


def test_update_reuses_the_plan_made_ahead_for_the_same_batch(monkeypatch):
    mem = _memory(([0, 1, 2], 0, 0), ([3, 4, 5], 1, 0))
    plans = []
    real = BalancedScoreMemory._plan
    monkeypatch.setattr(BalancedScoreMemory, "_plan",
                        lambda self, *a: plans.append(a) or real(self, *a))
    x, y = batch([6, 7], 1)
    ahead = mem.pending_scores(x, y, 0, 0)
    assert mem.update(x, y, 0, Scoring(id_score, scores=id_score(ahead))) == 5
    assert len(plans) == 1


def test_a_plan_made_ahead_is_not_used_for_another_update():
    # planned for (label 1, task 0, version 0); each case updates with one of them changed
    cases = [
        # another label: class 0 over quota instead of class 1
        ("label", [([0, 1, 2], 0, 0), ([3, 4, 5], 1, 0)], {"label": 0}),
        # another version: class 1's scores of version 0 must be made again
        ("version", [([0, 1, 2], 0, 0), ([3, 4, 5], 1, 0), ([6, 7], 1, 0)], {"version": 3}),
        # another task: class 0 (4 slots of task 0) is no longer ranked, only class 1
        ("task", [([0, 1, 2, 3], 0, 0), ([4, 5], 1, 0)], {"task": 1}),
    ]
    for name, fills, change in cases:
        mem, twin = _memory(*fills), _memory(*fills)
        assert mem.pending_scores(*batch([8, 9], 1), 0, 0) is not None, name
        x, y = batch([8, 9], change.get("label", 1))
        task, version = change.get("task", 0), change.get("version", 0)
        scored = mem.update(x, y, task, Scoring(id_score, version))
        assert scored == twin.update(x, y, task, Scoring(id_score, version)), name
        assert torch.equal(mem.x, twin.x) and torch.equal(mem.y, twin.y), name


def test_balanced_random_and_reservoir_never_score():
    rec = Recorder()
    for policy in ("balanced-random", "reservoir"):
        mem = memory_class(policy)(3, (2,))
        assert mem.update(*batch([0, 1, 2, 3], 0), 0, Scoring(rec)) == 0
    assert rec.calls == []


@pytest.mark.parametrize(
    ("policy", "selection"),
    [("balanced-random", "bottom"), ("balanced-score", "step"), ("balanced-score", "top"),
     ("balanced-score", "mix"), ("balanced-score", "kcenter"), ("balanced-score", "herding"),
     ("balanced-score", "bottom+past"),
     ("balanced-score", "kcenter+past")],
)
def test_balanced_invariants_on_an_irregular_stream(policy, selection):
    g = torch.Generator().manual_seed(7)
    cap = 17
    rule, _, past = selection.partition("+")
    mem = memory_class(policy)(cap, (2,), selection=rule, seed=5, rank_past=bool(past))
    scorer = lambda x: torch.sin(x[:, 0])  # noqa: E731 - arbitrary, reproducible scores
    next_id, offered = 0, set()
    for task in range(5):
        classes = [2 * task, 2 * task + 1]
        for _ in range(6):
            label = classes[int(torch.randint(2, (1,), generator=g))]
            b = int(torch.randint(1, 8, (1,), generator=g))
            ids = list(range(next_id, next_id + b))
            next_id += b
            cand = mem.class_counts()
            cand[label] = cand.get(label, 0) + b
            before = {c: ids_of(mem, c) for c in cand}
            mem.update(*batch(ids, label), task, Scoring(scorer, featurizer=lambda x: x))
            offered |= set(ids)
            counts = mem.class_counts()
            assert mem.size == min(cap, len(offered)) == sum(counts.values())
            stored = mem.x[: mem.size, 0].long().tolist()
            assert len(set(stored)) == len(stored) and set(stored) <= offered
            assert (mem.x[: mem.size, 1].long() == mem.y[: mem.size]).all()
            if sum(cand.values()) > cap:
                q = _reference_q(list(cand.values()), cap)
                for c, n in cand.items():
                    assert counts.get(c, 0) == n if n <= q else counts[c] in (q, q + 1)
                over = [counts[c] for c, n in cand.items() if n > q]
                assert max(over) - min(over) <= 1
            for c in before:  # a class never gains samples it was not offered
                if c != label:
                    assert ids_of(mem, c) <= before[c]


# ---------------------------------------------------------------- sampling


def test_sample_excludes_the_current_task():
    mem = BalancedRandomMemory(10, (2,), seed=2)
    mem.update(*batch(range(0, 4), 0), 0)
    assert mem.sample(3, exclude_task=0) is None
    assert mem.sample(0) is None
    mem.update(*batch(range(4, 10), 1), 1)
    for _ in range(20):
        x, y = mem.sample(3, exclude_task=1)
        assert x.shape == (3, 2) and (y == 0).all()
        assert len(set(x[:, 0].tolist())) == 3  # without replacement
    x, y = mem.sample(100, exclude_task=1)  # more than eligible: all eligible ones
    assert sorted(x[:, 0].long().tolist()) == [0, 1, 2, 3]
    x, y = mem.sample(100)
    assert sorted(x[:, 0].long().tolist()) == list(range(10))
    assert (x[:, 1].long() == y).all()


def test_sample_is_roughly_uniform():
    mem = BalancedRandomMemory(10, (2,), seed=4)
    mem.update(*batch(range(10), 0), 0)
    hits = torch.zeros(10)
    for _ in range(2000):
        x, _ = mem.sample(1)
        hits[int(x[0, 0])] += 1
    assert hits.min() >= 140 and hits.max() <= 260  # expected 200 each


def test_empty_memory_samples_nothing():
    assert ReservoirMemory(5, (2,)).sample(3) is None


# ---------------------------------------------------------------- reservoir


def test_reservoir_count_is_min_of_seen_and_capacity():
    mem = ReservoirMemory(25, (2,))
    for i in range(10):
        mem.update(*batch(range(7 * i, 7 * i + 7), i % 3), i // 4)
        assert mem.seen == 7 * (i + 1) and mem.size == min(7 * (i + 1), 25)
        stored = mem.x[: mem.size, 0].long().tolist()
        assert len(set(stored)) == len(stored)


def test_reservoir_keeps_every_sample_with_equal_probability():
    # 1000 samples into 50 slots: each kept with p = 0.05, i.e. 5 per block of 100 per run.
    blocks = torch.zeros(10)
    runs = 100
    for seed in range(runs):
        mem = ReservoirMemory(50, (2,), seed=seed)
        for s in range(0, 1000, 25):
            mem.update(*batch(range(s, s + 25), 0), 0)
        blocks += torch.bincount(mem.x[:, 0].long() // 100, minlength=10)
    assert blocks.sum() == 50 * runs
    assert ((blocks - 500).abs() <= 100).all(), blocks  # ~5 standard deviations


def test_reservoir_later_sample_wins_a_shared_slot():
    # Capacity 1: sequential reservoir keeps each of 20 samples with p = 1/20. If the first
    # sample of a batch won a shared slot, early batch positions would be strongly favoured.
    hits = torch.zeros(20)
    for seed in range(1500):
        mem = ReservoirMemory(1, (2,), seed=seed)
        mem.update(*batch(range(10), 0), 0)
        mem.update(*batch(range(10, 20), 0), 0)
        hits[int(mem.x[0, 0])] += 1
    assert hits.min() >= 45 and hits.max() <= 105, hits  # expected 75 each


# ---------------------------------------------------------------- determinism, persistence


def _state_equal(a: ReplayMemory, b: ReplayMemory) -> bool:
    s = a.size
    return (
        (a.size, a.seen) == (b.size, b.seen)
        and torch.equal(a.x[:s], b.x[:s])
        and all(
            torch.equal(getattr(a, n)[:s], getattr(b, n)[:s])
            for n in ("y", "task", "score", "score_version")
        )
    )


def _cos(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x[:, 0])


@pytest.mark.parametrize("policy", ["reservoir", "balanced-random", "balanced-score"])
def test_same_seed_same_memory_other_seed_other_memory(policy):
    def run(seed):
        mem = memory_class(policy)(12, (2,), seed=seed)
        for i in range(24):
            task = i // 6
            mem.update(*batch(range(5 * i, 5 * i + 5), 2 * task + i % 2), task,
                       Scoring(_cos, i // 4))
        return mem

    a, b, c = run(0), run(0), run(1)
    assert _state_equal(a, b)
    assert not _state_equal(a, c)  # past-class cuts and leftover order depend on the seed
    x1, _ = a.sample(5)
    x2, _ = b.sample(5)
    assert torch.equal(x1, x2)


@pytest.mark.parametrize("policy", ["reservoir", "balanced-random", "balanced-score"])
def test_state_dict_round_trip(policy):
    def feed(mem, start, stop):
        for i in range(start, stop):
            task = i // 6
            mem.update(*batch(range(5 * i, 5 * i + 5), 2 * task + i % 2), task,
                       Scoring(_cos, i // 4))

    a = memory_class(policy)(12, (2,), seed=0)
    feed(a, 0, 10)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = memory_class(policy)(12, (2,), seed=123)
    b.load_state_dict(torch.load(buf))
    assert _state_equal(a, b) and a.class_counts() == b.class_counts()
    feed(a, 10, 24)
    feed(b, 10, 24)
    assert _state_equal(a, b)
    assert torch.equal(a.sample(6, exclude_task=3)[0], b.sample(6, exclude_task=3)[0])


def test_load_state_dict_rejects_other_layouts():
    a = BalancedRandomMemory(12, (2,))
    with pytest.raises(ConfigError, match="capacity, shape"):
        BalancedRandomMemory(10, (2,)).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="capacity, shape"):
        ReservoirMemory(12, (2,)).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="missing"):
        a.load_state_dict({"capacity": 12})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_keeps_its_invariants():
    mem = BalancedScoreMemory(8, (2,), device="cuda", seed=0)
    mem.update(*batch(range(0, 6), 0), 0, Scoring(id_score))
    mem.update(*batch(range(6, 12), 1), 1, Scoring(id_score))
    assert mem.x.device.type == "cuda" and mem.class_counts() == {0: 4, 1: 4}
    assert ids_of(mem, 1) == {6, 7, 8, 9}
    x, y = mem.sample(10, exclude_task=1)
    assert x.device.type == "cuda" and (y == 0).all() and x.shape[0] == 4
    res = ReservoirMemory(8, (2,), device="cuda", seed=0)
    res.update(*batch(range(20), 0), 0)
    assert res.size == 8 and len(ids_of(res)) == 8


# ---------------------------------------------------------------- grouping and selection objects


class ByTask(Grouping):
    """A grouping other than classes: one group per task, equal shares."""

    name = "task"

    def key(self, y: np.ndarray, task: np.ndarray) -> np.ndarray:
        return task

    def allot(self, counts: np.ndarray, priority: np.ndarray, capacity: int) -> np.ndarray:
        return water_fill(counts, priority, capacity)


def test_a_selection_object_acts_like_its_name():
    named = BalancedScoreMemory(6, (2,), "top", seed=3)
    given = BalancedScoreMemory(6, (2,), get_selection("top"), seed=3)
    for i, label in enumerate([0, 1, 0, 1, 0]):
        for mem in (named, given):
            mem.update(*batch(range(10 * i, 10 * i + 4), label), task=0, scoring=Scoring(id_score))
    assert given.selection == "top"
    assert torch.equal(named.x, given.x) and torch.equal(named.y, given.y)
    assert named.state_dict()["selection"] == given.state_dict()["selection"]


def test_grouping_is_pluggable():
    mem = BalancedRandomMemory(8, (2,), grouping=ByTask(), seed=0)
    mem.update(*batch(range(0, 8), 0), task=0)  # task 0 fills the memory with class 0
    mem.update(*batch(range(100, 104), 0), task=1)  # same class, another task
    tasks = mem.task[: mem.size].tolist()
    assert sorted(tasks) == [0] * 4 + [1] * 4  # shared by task, not by class (all class 0)
    by_class = BalancedRandomMemory(8, (2,), seed=0)
    by_class.update(*batch(range(0, 8), 0), task=0)
    by_class.update(*batch(range(100, 104), 0), task=1)
    assert by_class.class_counts() == {0: 8}
    assert isinstance(by_class.grouping, ClassBalanced)


# ---------------------------------------------------------------- stream pacing


@pytest.mark.parametrize(
    ("counts", "current", "share", "expected"),
    [
        # current classes over their share: they keep 8 (4 + 4), the past water-fill 22
        ([6, 6, 20, 20], [1, 1, 0, 0], 8, [4, 4, 11, 11]),
        # current classes under their share keep everything, the past the rest (24)
        ([3, 3, 20, 20], [1, 1, 0, 0], 10, [3, 3, 12, 12]),
        # the past cannot fill its room: the current classes take what is left (24)
        ([20, 20, 3, 3], [1, 1, 0, 0], 5, [12, 12, 3, 3]),
    ],
)
def test_stream_paced_allotment_hand_computed(counts, current, share, expected):
    c = np.array(counts)
    keep = stream_paced(c, np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32),
                        np.array(current, dtype=bool), share, ClassBalanced(), 30)
    assert keep.tolist() == expected and int(keep.sum()) == 30


def test_stream_share_paces_the_current_task_by_the_stream():
    # task 0 fills 10 slots with classes 0, 1; task 1 offers 2 samples of classes 2, 3.
    # equal: q = 4 -> classes 2, 3 keep 1 each, classes 0, 1 keep 8 together.
    # stream: 2 of 12 samples seen belong to task 1 -> share 10 * 2 // 12 = 1 slot for it,
    # 9 for classes 0, 1.
    def fill(share):
        mem = BalancedRandomMemory(10, (2,), seed=0, current_share=share)
        mem.update(*batch(range(5), 0), 0)
        mem.update(*batch(range(5, 10), 1), 0)
        x = torch.cat([batch([10], 2)[0], batch([11], 3)[0]])
        mem.update(x, torch.tensor([2, 3]), 1)
        return mem.class_counts()

    equal, stream = fill("equal"), fill("stream")
    assert equal[0] + equal[1] == 8 and equal[2] == equal[3] == 1
    assert stream[0] + stream[1] == 9 and stream.get(2, 0) + stream.get(3, 0) == 1
    with pytest.raises(ConfigError, match="current_share"):
        BalancedRandomMemory(10, (2,), current_share="fast")


def test_stream_share_keeps_pending_scores_and_state_consistent():
    def mem():
        return BalancedScoreMemory(6, (2,), selection="step", seed=0,
                            current_share="stream")

    a = mem()
    a.update(*batch([0, 1, 2], 0), 0, Scoring(id_score))
    a.update(*batch([3, 4, 5], 1), 0, Scoring(id_score))
    a.update(*batch([6, 7], 2), 1, Scoring(id_score))
    x, y = batch([8, 9, 10], 2)
    ahead = a.pending_scores(x, y, 1, 0)  # planned with the batch counted, as update does
    b = mem()
    b.load_state_dict(a.state_dict())
    assert (b.current_task, b.current_seen, b.seen) == (1, 2, 8)
    scored = a.update(x, y, 1, Scoring(Recorder(), scores=ahead[:, 0].clone()))
    assert scored == ahead.shape[0] and b.update(x, y, 1, Scoring(id_score)) == scored
    assert _state_equal(a, b) and (a.current_task, a.current_seen) == (1, 5)


def test_current_share_reaches_the_memory_and_bad_values_are_rejected():
    from edgefcl.build import new_client
    from edgefcl.config import RunConfig, apply, validate
    from edgefcl.learn.models import build_model

    def share(**learn) -> str:
        cfg = apply(RunConfig(), {"learn": learn})
        client = new_client("c", build_model("mlp", (4,), 3), cfg.learn, cfg.fed, "vector")
        return client.learner.memory_spec.current_share

    assert share(current_share="stream", method="cbr") == "stream"
    assert share(current_share="equal", method="bi") == "equal"
    # auto (the default): stream for a score-ranked memory, equal for the cbr baseline
    assert share(method="bi") == share(method="vfcl") == "stream"
    assert share(method="cbr") == "equal"
    with pytest.raises(ConfigError, match="current_share must be equal, stream or auto"):
        validate(apply(RunConfig(), {"learn": {"current_share": "fast"}}))


def test_every_policy_names_its_class():
    for name in POLICIES:
        cls = memory_class(name)
        assert issubclass(cls, ReplayMemory) and cls.name == name
    assert [p for p in POLICIES if memory_class(p).scored] == ["balanced-score"]


class Mine(BalancedScoreMemory):
    name = "mine"


def test_a_new_policy_is_its_class_and_one_registry_line(monkeypatch):
    """A class named in a new registry entry makes a policy: built through the registry, it
    acts as its class (a score-ranked one needs a scorer), keeps its name in the state, and
    `current_share auto` is its own; unknown names list the registry."""
    from edgefcl.config import resolve_current_share

    mine = MemoryPolicy("mine", f"{__name__}:Mine", current_share="stream", help="")
    monkeypatch.setitem(POLICIES, "mine", mine)
    mem = memory_class("mine")(2, (2,), seed=0)
    x, y = torch.zeros(3, 2), torch.tensor([0, 1, 1])
    with pytest.raises(ConfigError, match="'mine' memory needs a scorer"):
        mem.update(x, y, 0)
    assert mem.update(x, y, 0, Scoring(lambda s: torch.arange(len(s), dtype=torch.float32))) > 0
    assert mem.state_dict()["policy"] == "mine"
    with pytest.raises(ConfigError, match="capacity, shape, policy"):
        BalancedScoreMemory(2, (2,)).load_state_dict(mem.state_dict())
    assert resolve_current_share("auto", "mine") == "stream"
    assert resolve_current_share("auto", "reservoir") == "equal"
    with pytest.raises(ConfigError, match="choose from .*mine"):
        get_policy("nope")


@pytest.mark.parametrize("policy", ["balanced-score", "balanced-random", "reservoir"])
def test_an_update_reads_back_only_the_kept_mask_and_a_draw_nothing(policy):
    # the allotment read the memory's labels, tasks, groups and score versions back from the
    # device at every update (13.7 waits a mini-batch for BI on the demo, 0.9 now)
    cls = memory_class(policy)

    def new() -> ReplayMemory:
        return cls(8, (2,), selection="bottom", seed=0) if cls.scored else cls(8, (2,), seed=0)

    mem = new()
    scoring = Scoring(id_score, 0) if cls.scored else None
    for k in range(3):  # full, every class known
        x, y = batch(range(4 * k, 4 * k + 4), k % 2)
        mem.update(x, y, 0, scoring, labels=y.numpy())
    x, y = batch(range(20, 24), 1)
    labels = y.numpy()
    with counting() as reads:
        mem.update(x, y, 0, scoring, labels=labels)
    # the kept mask; a scorer's scores are checked for NaN too; the reservoir reads its draws
    assert sum(reads.values()) == (2 if cls.scored else 1), reads
    with counting() as reads:
        assert mem.sample(4, exclude_task=1) is not None
    assert sum(reads.values()) == 0, reads
    twin = new()
    twin.load_state_dict(mem.state_dict())  # the host copies come back with a checkpoint
    assert twin.class_counts() == mem.class_counts() == dict(zip(
        *np.unique(mem.y[:mem.size].numpy(), return_counts=True), strict=True))
