"""The local optimizers give torch.optim's bits and read and write its state dicts."""

from __future__ import annotations

import copy

import pytest
import torch

from edgefcl.learn.optimizers import SGD, Adam


def models():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return net, copy.deepcopy(net)


def train(net, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("ours,theirs", [
    (lambda p: Adam(p, lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01, fused=True)),
    (lambda p: SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
])
def test_steps_are_torch_optims_bit_for_bit(ours, theirs):
    a, b = models()
    train(a, ours(a.parameters()), 7)
    train(b, theirs(b.parameters()), 7)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_second_group_and_a_parameter_without_gradient():
    """APC adds a group; a frozen parameter (no gradient) keeps its value and gets no state."""
    a, b = models()
    extra_a, extra_b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    mine = Adam(list(a.parameters())[:2], lr=0.01)
    mine.add_param_group({"params": [*list(a.parameters())[2:], extra_a]})
    ref = torch.optim.Adam(list(b.parameters())[:2], lr=0.01, fused=True)
    ref.add_param_group({"params": [*list(b.parameters())[2:], extra_b]})
    train(a, mine, 4)
    train(b, ref, 4)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert torch.equal(extra_a, torch.ones(3)) and extra_a not in mine.state
    assert [len(g["params"]) for g in mine.state_dict()["param_groups"]] == [2, 3]


def test_state_dicts_cross_both_ways():
    """A checkpoint written with torch.optim.Adam resumes here, and the other way round, on
    the same bits as an uninterrupted run."""
    a, b = models()
    ref = torch.optim.Adam(b.parameters(), lr=0.01, fused=True)
    train(b, ref, 3)
    a.load_state_dict(b.state_dict())
    mine = Adam(a.parameters(), lr=0.5)  # the learning rate comes back from the state dict
    mine.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert mine.param_groups[0]["lr"] == 0.01
    train(a, mine, 3, seed=2)
    train(b, ref, 3, seed=2)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    back = torch.optim.Adam(b.parameters(), lr=0.01, fused=True)
    back.load_state_dict(copy.deepcopy(mine.state_dict()))
    for k, v in ref.state_dict()["state"][0].items():
        assert torch.equal(back.state_dict()["state"][0][k], v)


def test_a_state_dict_of_other_groups_is_refused():
    a, _ = models()
    mine = Adam(a.parameters(), lr=0.01)
    other = Adam(list(a.parameters())[:2], lr=0.01)
    with pytest.raises(ValueError, match="parameter groups"):
        mine.load_state_dict(other.state_dict())
