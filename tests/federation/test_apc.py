"""APC / FedWeIT: decomposed layers, penalty, task bookkeeping, payloads, server aggregation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgefcl.config import ConfigError, FedConfig, LearnConfig, RunConfig, apply, resolve_fed
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.apc_rule import KB_NEXT, APCEncoder, APCFedAvg
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.sparse import (
    IDX,
    KB,
    ROWS,
    VAL,
    decode_indices,
    encode_indices,
    to_bfloat16,
)
from edgefcl.learn.apc_layers import APC, APCLayer, decompose, local_keys, shared_tensors
from edgefcl.learn.params import get_tensors

sig = torch.sigmoid


def test_linear_composition_by_hand():
    lin = nn.Linear(3, 2)
    layer = APCLayer(lin)
    layer.init_kb(2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
        layer.mask.copy_(torch.tensor([0.0, 100.0]))  # sigmoid: 0.5 and 1
        layer.adaptive.fill_(0.1)
        layer.kb[0].fill_(1.0)
        layer.kb[1].fill_(2.0)
        layer.alpha.copy_(torch.tensor([0.5, -1.0]))
    # row 0: 0.5 * B + 0.1 + (0.5 - 2) ; row 1: B + 0.1 - 1.5
    want = torch.tensor([[0.5 - 1.4, 1.0 - 1.4, 1.5 - 1.4], [4 - 1.4, 5 - 1.4, 6 - 1.4]])
    torch.testing.assert_close(layer.composed(), want)
    x = torch.randn(4, 3)
    torch.testing.assert_close(layer(x), F.linear(x, want, lin.bias))


def test_conv_composition_masks_output_channels():
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
    layer = APCLayer(conv)
    with torch.no_grad():
        layer.mask.copy_(torch.tensor([0.0, 100.0, -100.0]))
    w = layer.composed()
    torch.testing.assert_close(w[0], 0.5 * conv.weight[0])
    torch.testing.assert_close(w[1], conv.weight[1])
    assert float(w[2].detach().abs().max()) < 1e-30
    x = torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(layer(x), F.conv2d(x, w, None, padding=1))


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_decompose_keeps_the_plain_names_as_the_global():
    plain = small_model()
    names = list(get_tensors(plain))
    model = decompose(small_model())
    assert decompose(model) is model  # idempotent
    state = get_tensors(model)
    assert local_keys(model) == {"1.mask", "1.adaptive", "1.alpha", "3.mask", "3.adaptive",
                                 "3.alpha"}
    assert list(shared_tensors(model, state)) == names
    np.testing.assert_array_equal(state["1.weight"], get_tensors(plain)["1.weight"])
    with pytest.raises(ConfigError):
        decompose(nn.Sequential(nn.ReLU()))


class FakeClient:
    """What the hooks touch on a Client: model, optimizer, encoder, fed."""

    def __init__(self, learn: LearnConfig, kb_size: int = 2) -> None:
        self.hooks = APC(learn)
        self.model = self.hooks.prepare_model(small_model())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.encoder = APCEncoder()
        self.fed = FedConfig(encoding="apc", apc_kb_size=kb_size)
        self.hooks.attach(self)


def test_penalty_l1_and_retroactive_term_by_hand():
    c = FakeClient(LearnConfig(method="apc", apc_l1=0.1, apc_l2=100.0, apc_prune=0.05))
    lay, head = c.hooks.layers["1.weight"], c.hooks.layers["3.weight"]
    with torch.no_grad():
        head.adaptive.fill_(0.2)
    # L1: 0.1 * (sigmoid(0) over 3 + 2 units + |A| over the head's 6 entries)
    assert c.hooks.penalty(c).detach().item() == pytest.approx(0.1 * (0.5 * 5 + 0.2 * 6))
    c.hooks.on_task_start(c, 0)
    c.hooks.on_task_start(c, 1)  # task 0 done: theta(0) stored, A and alpha reset
    assert len(lay.past) == 1 and float(head.adaptive.detach().abs().sum()) == 0
    torch.testing.assert_close(head.past[0][1], 0.5 * head.weight.detach() + 0.2)
    with torch.no_grad():
        lay.weight[0, 0] += 0.04  # theta moves by 0.5 * 0.04 = 0.02 < prune: A(0) = 0
        lay.weight[1, 1] += 1.0  # moves by 0.5 >= prune: A(0) absorbs it, no residual
        head.weight[0, 0] += 0.04  # head: A(0) = 0.2 - 0.02 absorbs it
    retro = 0.5 * 100.0 * 0.02 ** 2
    assert c.hooks.penalty(c).detach().item() == pytest.approx(0.1 * 0.5 * 5 + retro, rel=1e-4)
    assert float(lay.past_adaptive(0, 0.05)[1, 1]) == pytest.approx(-0.5)
    assert float(head.past_adaptive(0, 0.05)[0, 0]) == pytest.approx(0.18)


def test_payload_rows_by_mask_and_knowledge_base_once():
    c = FakeClient(LearnConfig(method="apc", apc_send=0.5, apc_prune=0.15))
    lay = c.hooks.layers["1.weight"]
    with torch.no_grad():
        lay.mask.copy_(torch.tensor([-1.0, 2.0, 1.0]))
    state = get_tensors(c.model)
    out = c.encoder.encode(state, state)
    # ceil(0.5 * 3) = 2 units with the largest masks: rows 1 and 2
    assert decode_indices(out["1.weight" + ROWS], 3).tolist() == [1, 2]
    np.testing.assert_array_equal(out["1.weight" + VAL], state["1.weight"][[1, 2]].ravel())
    assert "1.bias" in out and "1.mask" not in out and not any(KB in k for k in out)
    with torch.no_grad():
        lay.adaptive.copy_(torch.tensor([[0.1, 0.2, 0, 0], [0, 0, -0.3, 0], [0, 0, 0, 0]]))
    c.hooks.on_task_start(c, 0)
    c.hooks.on_task_start(c, 1)
    out = c.encoder.encode(get_tensors(c.model), state)
    key = "1.weight" + KB
    assert decode_indices(out[key + IDX], 12).tolist() == [1, 6]  # 0.1 pruned at 0.15
    np.testing.assert_allclose(out[key + VAL], [0.2, -0.3])
    g = GlobalModel(1, {k: v for k, v in state.items() if k not in c.hooks.local_keys})
    c.hooks.on_global(c, g)
    assert not any(KB in k for k in c.encoder.encode(get_tensors(c.model), state))


def test_decode_global_takes_shared_tensors_and_keeps_local_ones_as_sent():
    c = FakeClient(LearnConfig(method="apc"))
    sent = get_tensors(c.model)
    c.encoder.encode(sent, sent)
    now = {k: v + 1.0 for k, v in sent.items()}  # trained after sending
    g = {k: np.zeros_like(v) for k, v in sent.items() if k not in c.hooks.local_keys}
    merged = c.encoder.decode_global(g, now)
    for k in sent:
        want = sent[k] if k in c.hooks.local_keys else 0.0
        np.testing.assert_array_equal(merged[k], want)  # + (now - sent) in a delta merge


def apc_update(client, rows, vals, kb=None, n=10, seq=1, batch=4, task=0, base=0):
    t = {"w" + ROWS: encode_indices(np.array(rows)), "w" + VAL: np.array(vals, np.float32),
         "b": np.full(2, float(n), np.float32)}
    if kb is not None:
        t["w" + KB + IDX] = encode_indices(np.array(kb[0]))
        t["w" + KB + VAL] = np.array(kb[1], np.float32)
    return Update(client, base, seq, task, batch, n, t, "apc")


def make_agg(kb_size=2, **kw):
    fed = FedConfig(clients=2, burn_in=2, jump=2, encoding="apc", apc_kb_size=kb_size, **kw)
    return Aggregator({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}, fed)


def test_server_averages_rows_over_senders_and_fills_the_knowledge_base():
    # sample-weighted (the default cap weighs two alike), the plain ring (no clipping: B is 0)
    agg = make_agg(max_share=1.0, clip_factor=0.0)
    agg.submit(apc_update("a", [0], [2.0, 2.0], kb=([1], [5.0]), n=10))
    closed = agg.submit(apc_update("b", [0, 1], [6.0, 6.0, 8.0, 8.0], n=30))
    g = closed.global_.tensors
    # row 0: (10*2 + 30*6)/40 = 5 -> mixed 2.5; row 1: only b -> 4; b: (100+900)/40 -> 12.5
    np.testing.assert_allclose(g["w"], [[2.5, 2.5], [4.0, 4.0]])
    np.testing.assert_allclose(g["b"], [12.5, 12.5])
    np.testing.assert_array_equal(g["w" + KB], [[[0, 5.0], [0, 0]], [[0, 0], [0, 0]]])
    assert int(g[KB_NEXT]) == 1
    # two more contributions: slot 1, then slot 0 again (ring of 2)
    agg.submit(apc_update("a", [1], [0, 0], kb=([0], [1.0]), seq=2, batch=6, task=1))
    closed = agg.submit(apc_update("b", [1], [0, 0], kb=([3], [2.0]), seq=2, batch=6, task=1))
    g = closed.global_.tensors
    np.testing.assert_array_equal(g["w" + KB], [[[0, 0], [0, 2.0]], [[1.0, 0], [0, 0]]])
    assert int(g[KB_NEXT]) == 3


@pytest.mark.parametrize("rows,vals,reason", [
    ([2], [1, 1], "index-range"),
    ([0], [1, 1, 1], "length"),
    ([1, 0], [1, 1, 1, 1], "index-duplicate"),
])
def test_aggregator_rejects_bad_apc_rows(rows, vals, reason):
    agg = make_agg()
    t = {"w" + ROWS: np.array(rows, np.uint8), "w" + VAL: np.array(vals, np.float32),
         "b": np.zeros(2, np.float32)}
    agg.submit(Update("a", 0, 1, 0, 4, 10, t, "apc"))
    assert agg.counters[f"rejected_{reason}"] == 1


def test_one_device_cannot_own_the_knowledge_base_nor_write_it_at_the_bound():
    """An attacker sent a contribution at +-1e6 with every update (honest devices send one
    per finished task), and after a few rounds every slot of the ring was its own."""
    fed = FedConfig(clients=3, burn_in=2, jump=2, encoding="apc", apc_kb_size=5,
                    min_clients=3)
    w = np.ones((2, 2), np.float32)  # the base B: norm 2
    agg = Aggregator({"w": w, "b": np.zeros(2, np.float32)}, fed)
    honest = {"h": 0.1, "i": 0.2}
    for seq in range(1, 9):  # the attacker claims a new task every round
        for c, v in honest.items():
            kb = ([0, 3], [v, v]) if seq in (1, 5) else None  # tasks 0 and 1 end
            agg.submit(apc_update(c, [0], [1, 1], kb=kb, seq=seq, batch=2 + 2 * seq,
                                  task=(seq >= 5), base=agg.global_.version))
        closed = agg.submit(apc_update("e", [0], [1, 1], kb=([0, 1, 2, 3], [1e6] * 4),
                                       seq=seq, batch=2 + 2 * seq, task=seq,
                                       base=agg.global_.version))
        assert closed is not None and closed.global_ is not None
    kb = closed.global_.tensors["w" + KB]
    norms = np.linalg.norm(kb.reshape(5, -1), axis=1)
    owners = agg.strategy.owners
    assert owners.count("e") == 2  # its share: twice an equal one of 3 clients, at most half
    assert owners.count("h") + owners.count("i") == 3
    assert norms.max() <= 3 * 2.0 + 1e-5  # clip_factor x the base's norm
    assert agg.counters["kb_clipped"] == 8 and agg.counters["kb_own_slot"] == 5
    # a second contribution to a task a device already contributed to is left out
    agg.submit(apc_update("h", [0], [1, 1], kb=([1], [9.0]), seq=9, batch=20, task=1,
                          base=agg.global_.version))
    agg.submit(apc_update("i", [0], [1, 1], seq=9, batch=20, task=1,
                          base=agg.global_.version))
    closed = agg.submit(apc_update("e", [0], [1, 1], seq=9, batch=20, task=9,
                                   base=agg.global_.version))
    assert agg.counters["kb_repeated"] == 1
    np.testing.assert_array_equal(closed.global_.tensors["w" + KB], kb)
    # what the ring's owners are survives a restart
    again = Aggregator({"w": w, "b": np.zeros(2, np.float32)}, fed)
    again.load_state(agg.state())
    assert again.strategy.owners == owners and again.strategy.kb_task == agg.strategy.kb_task


@pytest.mark.parametrize("form", ["rows", "idx", "rows_bf16"])
def test_a_row_only_one_device_sends_moves_no_further_than_an_honest_change(form):
    """apc's rows are absolute values averaged over their senders: a row only the attacker
    sent (at 1e6, one sample) was set by it alone, 5e5 after one round and 8.75e5 after
    three. Its change on the global is clipped like a sparse update's."""
    fed = FedConfig(clients=5, burn_in=2, jump=2, encoding="apc", min_clients=5)
    w = np.full((4, 4), 0.1, np.float32)
    agg = Aggregator({"w": w, "b": np.zeros(4, np.float32)}, fed)

    def update(c, seq, rows, value, n=10, form="rows"):
        vals = np.full(len(rows) * 4, value, np.float32)
        if form == "idx":  # the same entries by flat position
            t = {"w" + IDX: encode_indices(np.array([4 * r + k for r in rows for k in range(4)])),
                 "w" + VAL: vals}
        elif form == "rows_bf16":
            t = {"w" + ROWS: encode_indices(np.array(rows)), "w::bf16": to_bfloat16(vals)}
        else:
            t = {"w" + ROWS: encode_indices(np.array(rows)), "w" + VAL: vals}
        return Update(c, agg.global_.version, seq, 0, 2 + 2 * seq, n,
                      {**t, "b": np.zeros(4, np.float32)}, "apc")

    for seq in (1, 2, 3):
        for i, c in enumerate("hijk"):  # honest devices move rows 0 and 1 a little
            agg.submit(update(c, seq, [0, 1], 0.1 + 0.01 * (i + seq)))
        closed = agg.submit(update("e", seq, [3], 1e6, n=1, form=form))
        g = closed.global_.tensors["w"]
    assert agg.counters["clipped"] == 3
    assert abs(g[3, 0] - 0.1) < 1.0  # moved at most about 3 x an honest change a round
    assert 0.1 < g[0, 0] < 0.2


def test_apc_change_norm_and_its_clip_by_hand():
    from edgefcl.federation.sparse import entries_change_norm, scaled_entries_change

    ref = {"w": np.full((2, 2), 1.0, np.float32), "b": np.zeros(2, np.float32),
           "w" + KB: np.zeros((3, 2, 2), np.float32)}
    t = {"w" + ROWS: encode_indices(np.array([1])), "w" + VAL: np.array([4, 5], np.float16),
         "b": np.array([0, 4], np.float32),
         "w" + KB + IDX: encode_indices(np.array([0])), "w" + KB + VAL: np.ones(1, np.float32)}
    # changes: row 1 (4-1, 5-1) = (3, 4), b (0, 4): sqrt(9 + 16 + 16); the kb is no change
    assert entries_change_norm(t, ref) == pytest.approx(np.sqrt(41))
    half = scaled_entries_change(t, 0.5, ref)
    np.testing.assert_array_equal(half["w" + VAL], [2.5, 3.0])
    assert half["w" + VAL].dtype == np.float16
    np.testing.assert_array_equal(half["b"], [0, 2])
    assert half["w" + KB + VAL] is t["w" + KB + VAL] and half["w" + ROWS] is t["w" + ROWS]


@pytest.mark.parametrize("clients, share, quota", [(3, 0.0, 2), (2, 0.0, 3), (10, 0.0, 1),
                                                   (3, 1.0, 5), (4, 0.25, 2)])
def test_the_knowledge_base_slot_quota(clients, share, quota):
    # the cap's share of the 5 slots, and never so few that the fleet cannot fill the ring
    # (two devices at 2 each left a slot empty for the whole run)
    s = APCFedAvg(FedConfig(clients=clients, max_share=share, apc_kb_size=5),
                  {"w": (2, 2), "b": (2,)})
    assert s._slot_quota() == quota


def test_server_strategy_without_knowledge_base():
    s = APCFedAvg(FedConfig(mix=1.0, apc_kb_size=0), {"w": (2, 2), "b": (2,)})
    s.add(apc_update("a", [1], [3.0, 3.0], kb=([0], [1.0])))
    g = s.result({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)})
    assert set(g) == {"w", "b"} and g["w"].tolist() == [[0, 0], [3, 3]]


def test_method_apc_implies_the_apc_encoding():
    assert resolve_fed("apc", FedConfig()).encoding == "apc"
    assert apply(RunConfig(), {"learn": {"method": "apc"}}).fed.encoding == "apc"
    with pytest.raises(ConfigError, match="needs"):
        apply(RunConfig(), {"compare": "bi", "fed": {"encoding": "apc"}})
    with pytest.raises(ConfigError, match="needs"):
        apply(RunConfig(), {"learn": {"method": "apc"}, "fed": {"encoding": "sparse"}})


def test_apc_run_end_to_end():
    from edgefcl.sim.runs import simulate

    cfg = apply(RunConfig(), {
        "quiet": True, "data": {"tasks": 2}, "fed": {"clients": 2},
        "learn": {"method": "apc", "local_epochs": 1, "hidden": 32, "model": "mlp",
                  "memory_size": 20}})
    r = simulate(cfg)
    assert r.rounds > 5 and r.extra["aggregator"]["accepted"] > 10
    assert not any(k.startswith("rejected") for k in r.extra["aggregator"])
    assert r.accuracy > 50.0  # 2 tasks of 5 digits each: chance is 10%
