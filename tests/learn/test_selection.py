"""Selection rules of the class-balanced memory (edgefcl.learn.selection), hand-computed."""

from __future__ import annotations

import pytest
import torch

from edgefcl.config import ConfigError
from edgefcl.learn.selection import SELECTIONS, Candidates, get_selection, grouped_rank


def cands(cls, keep, score=None, features=None, seed=0) -> Candidates:
    cls_t = torch.as_tensor(cls, dtype=torch.int64)
    counts = torch.bincount(cls_t)
    score_t = torch.as_tensor(score if score is not None else [0.0] * len(cls),
                              dtype=torch.float32)
    f = None if features is None else torch.as_tensor(features, dtype=torch.float32)
    return Candidates(cls_t, counts, torch.as_tensor(keep, dtype=torch.int64), score_t, f,
                      torch.Generator().manual_seed(seed))


def kept(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).squeeze(1).tolist()


def test_registry_names_and_unknown_name():
    assert set(SELECTIONS) >= {"bottom", "top", "step", "mix", "kcenter"}
    assert get_selection("step").name == "step"
    with pytest.raises(ConfigError, match="unknown selection 'middle'"):
        get_selection("middle")


def test_grouped_rank():
    cls = torch.tensor([0, 0, 1, 1, 1])
    key = torch.tensor([3.0, 1.0, 2.0, 0.0, 5.0])
    assert grouped_rank(cls, key, torch.tensor([2, 3])).tolist() == [1, 0, 1, 0, 2]
    # ties: lower index first
    assert grouped_rank(torch.zeros(3, dtype=torch.int64), torch.zeros(3),
                        torch.tensor([3])).tolist() == [0, 1, 2]


def test_bottom_and_top():
    # class 0: scores 0.5 0.1 0.9 keep 2; class 1: scores 0.3 0.2 keep 1
    c = cands([0, 0, 0, 1, 1], [2, 1], [0.5, 0.1, 0.9, 0.3, 0.2])
    assert kept(get_selection("bottom").select(c)) == [0, 1, 4]
    assert kept(get_selection("top").select(c)) == [0, 2, 3]


def test_step_keeps_evenly_spaced_ranks():
    # 8 candidates keep 3: r kept iff (3 r) mod 8 < 3 -> ranks 0, 3, 6
    score = [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]  # rank r is index 7 - r
    c = cands([0] * 8, [3], score)
    assert sorted(7 - i for i in kept(get_selection("step").select(c))) == [0, 3, 6]
    # keep all / keep 1 (the least uncertain)
    assert kept(get_selection("step").select(cands([0] * 3, [3], [2.0, 0.0, 1.0]))) == [0, 1, 2]
    assert kept(get_selection("step").select(cands([0] * 3, [1], [2.0, 0.0, 1.0]))) == [1]


def test_mix_keeps_the_lowest_half_and_a_random_rest():
    score = [float(i) for i in range(8)]
    seen = set()
    for seed in range(20):
        k = kept(get_selection("mix").select(cands([0] * 8, [4], score, seed=seed)))
        assert len(k) == 4 and {0, 1} <= set(k)  # floor(4 / 2) = 2 lowest always kept
        seen |= set(k) - {0, 1}
    assert seen == set(range(2, 8))  # the rest is drawn from every other candidate
    # keep 1: no low part, one random pick
    picks = {tuple(kept(get_selection("mix").select(cands([0] * 4, [1], [0, 1, 2, 3],
                                                          seed=s)))) for s in range(20)}
    assert len(picks) > 1 and all(len(p) == 1 for p in picks)


def test_random_draws_uniformly_within_each_class():
    rule = get_selection("random")
    assert not rule.needs_scores and not rule.needs_features
    # class 0: 4 candidates keep 2, class 1: 2 candidates keep 1; scores must not matter
    hits = torch.zeros(6)
    for seed in range(400):
        mask = rule.select(cands([0, 0, 0, 0, 1, 1], [2, 1], [0, 1, 2, 3, 0, 1], seed=seed))
        assert mask[:4].sum() == 2 and mask[4:].sum() == 1
        hits += mask.float()
    # each candidate of class 0 is kept with probability 1/2, of class 1 with 1/2: 200 of 400
    # expected, sd 10; 60 is 6 sd away
    assert ((hits - 200).abs() < 60).all(), hits


def test_kcenter_farthest_first_from_the_point_nearest_the_mean():
    # class 0 on a line at 0, 1, 2, 10: mean 3.25 -> first pick 2 (index 2); farthest from
    # {2}: 10 (index 3); then farthest from {2, 10}: 0 (index 0).
    # class 1 at 5, 6: mean 5.5, both at 0.5 -> the lower index (4).
    feats = [[0.0], [1.0], [2.0], [10.0], [5.0], [6.0]]
    rule = get_selection("kcenter")
    assert not rule.needs_scores and rule.needs_features
    assert kept(rule.select(cands([0, 0, 0, 0, 1, 1], [2, 1], features=feats))) == [2, 3, 4]
    assert kept(rule.select(cands([0, 0, 0, 0, 1, 1], [3, 2], features=feats))) == [0, 2, 3, 4, 5]
    # 2-d: a tight cluster and one outlier; 2 picks = one from the cluster + the outlier
    f2 = [[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0]]
    assert 3 in kept(rule.select(cands([0] * 4, [2], features=f2)))


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_every_rule_keeps_exactly_its_allotment(name):
    g = torch.Generator().manual_seed(1)
    cls = torch.randint(0, 5, (60,), generator=g)
    counts = torch.bincount(cls, minlength=5)
    keep = torch.minimum(counts, torch.tensor([3, 0, 7, 100, 1]))
    c = Candidates(cls, counts, keep, torch.rand(60, generator=g), torch.rand(60, 4, generator=g),
                   torch.Generator().manual_seed(2))
    mask = get_selection(name).select(c)
    assert torch.equal(torch.bincount(cls[mask], minlength=5), keep)


def test_herding_keeps_the_mean_closest_to_the_class_mean():
    # unit vectors a = (1, 0), b = (0, 1), c = (-1, 0): class mean (0, 1/3).
    # 1 pick: distances |mean - x| = 1.054, 0.667, 1.054 -> b.
    # 2 picks: mean of {b, a} = (0.5, 0.5) and of {b, c} = (-0.5, 0.5) are both 0.527 away
    # -> the lower index, a.
    feats = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]
    rule = get_selection("herding")
    assert not rule.needs_scores and rule.needs_features
    assert kept(rule.select(cands([0, 0, 0], [1], features=feats))) == [1]
    assert kept(rule.select(cands([0, 0, 0], [2], features=feats))) == [0, 1]
    # features are L2-normalised first: a scaled copy of b is the same point
    feats = [[3.0, 0.0], [0.0, 7.0], [-1.0, 0.0]]
    assert kept(rule.select(cands([0, 0, 0], [1], features=feats))) == [1]
