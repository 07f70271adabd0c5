"""The Strategy contract: one long-lived object per run, a round opened by configure_round,
mixing with the previous global done once (in `Strategy.mix`), per-round counters, and the
declared (not yet implemented) partial/merge of sum-decomposable rules."""

from __future__ import annotations

import numpy as np
import pytest

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.registry import ENCODINGS
from edgefcl.federation.rules import DENSE_RULES
from edgefcl.federation.strategy import FedAvg, RoundInput, Strategy

FED = FedConfig(clients=2, burn_in=0, jump=1, min_clients=2, clip_factor=0, max_share=1)


def upd(client: str, value: float, seq: int, base: int = 0, n: int = 10) -> Update:
    return Update(client, base, seq, 0, seq, n, {"w": np.full(2, value, np.float32)})


def run_rounds(agg: Aggregator, values: list[tuple[float, float]]) -> list[np.ndarray]:
    out = []
    for r, (a, b) in enumerate(values, start=1):
        agg.submit(upd("a", a, r, base=r - 1))
        closed = agg.submit(upd("b", b, r, base=r - 1))
        assert closed is not None and closed.global_ is not None
        out.append(closed.global_.tensors["w"])
    return out


def test_one_strategy_lives_for_the_whole_run() -> None:
    agg = Aggregator({"w": np.zeros(2, np.float32)}, FED)
    first = agg.strategy
    run_rounds(agg, [(1.0, 3.0), (5.0, 5.0), (0.0, 0.0)])
    assert agg.strategy is first and agg.rounds == 3


def test_each_round_starts_fresh_and_mixes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    plain_mix = Strategy.mix

    def counted(self, new, previous, sent):  # noqa: ANN001, ANN202
        calls.append(1)
        return plain_mix(self, new, previous, sent)

    monkeypatch.setattr(Strategy, "mix", counted)
    agg = Aggregator({"w": np.zeros(2, np.float32)}, FED)
    g1, g2 = run_rounds(agg, [(2.0, 4.0), (10.0, 10.0)])
    # round 1: mean 3 mixed once with 0 -> 1.5; round 2 sees only its own updates: 10 -> 5.75
    assert g1.tolist() == [1.5, 1.5] and g2.tolist() == [5.75, 5.75]
    assert len(calls) == 2


class RoundCounter(FedAvg):
    """A rule with server state across rounds (here: how many rounds it aggregated), the kind
    of thing server momentum needs; it must survive configure_round."""

    def __init__(self, fed: FedConfig, spec: dict) -> None:
        self.rounds_seen = 0
        super().__init__(fed, spec)

    def configure_round(self, rnd: RoundInput) -> None:
        super().configure_round(rnd)
        self.rounds_seen += 1
        self.counts["rounds_seen"] = self.rounds_seen


def test_server_state_survives_rounds_and_counters_are_per_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DENSE_RULES, "count", RoundCounter)
    agg = Aggregator({"w": np.zeros(2, np.float32)}, FedConfig(**{**FED.__dict__,
                                                                  "aggregation": "count"}))
    run_rounds(agg, [(1.0, 1.0)] * 3)
    assert agg.strategy.rounds_seen == 3
    assert agg.counters["rounds_seen"] == 1 + 2 + 3  # each round's counters added once


def test_configure_round_passes_the_round() -> None:
    seen: list[RoundInput] = []

    class Spy(FedAvg):
        def configure_round(self, rnd: RoundInput) -> None:
            super().configure_round(rnd)
            seen.append(rnd)

    agg = Aggregator({"w": np.zeros(2, np.float32)}, FED)
    agg.strategy = Spy(FED, agg.spec)
    run_rounds(agg, [(1.0, 1.0), (2.0, 2.0)])
    assert [(r.version, r.participants) for r in seen] == [(0, ("a", "b")), (1, ("a", "b"))]
    assert seen[1].bases(0) is not None and seen[1].bases(0)["w"].tolist() == [0.0, 0.0]


def test_partial_and_merge_are_declared_on_the_base() -> None:
    s = FedAvg(FED, {"w": (2,)})
    assert Strategy.decomposable is False
    with pytest.raises(NotImplementedError):
        Strategy.partial(s)
    with pytest.raises(NotImplementedError):
        Strategy.merge(s, {})


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_every_rule_of_every_encoding_is_a_strategy(encoding: str) -> None:
    for rule in ENCODINGS[encoding].rules.values():
        assert issubclass(rule, Strategy)


def test_sparse_rebased_is_counted_per_round() -> None:
    from edgefcl.federation.sparse import SparseEncoder, SparseFedAvg

    g: Tensors = {"w": np.zeros((2, 2), np.float32)}
    s = SparseFedAvg(FedConfig(encoding="sparse"), {"w": (2, 2)})
    s.configure_round(RoundInput(5, g, lambda v: None))  # base 0 no longer held
    payload = SparseEncoder(topk=1.0).encode({"w": np.ones((2, 2), np.float32)}, g)
    s.add(Update("a", 0, 1, 0, 1, 1, payload, "sparse"))
    assert s.counters()["sparse_rebased"] == 1
    s.configure_round(RoundInput(6, g, lambda v: g))
    assert s.counters()["sparse_rebased"] == 0
