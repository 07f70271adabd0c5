"""The task gate's round holds every device's end-of-task model (`federation/task_ends.py`):
the kept updates by hand, the round it closes with hand-computed values, what it never does
(count an update twice, give a device two entries, carry another task's update, grow past
its budget), and the tiny-task fleet on a congested link that it keeps from collapsing."""

from __future__ import annotations

import numpy as np

from edgefcl.config import FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.federation.task_ends import TaskEnds
from edgefcl.sim.runs import simulate


def upd(client: str, seq: int, value: float, task: int = 0, base: int = 0) -> Update:
    return Update(client, base, seq, task, seq, 10, {"w": np.full(2, value, np.float32)})


def test_task_ends_keep_the_newest_update_per_client_within_the_budget():
    ends = TaskEnds(budget=2 * upd("a", 1, 0.0).nbytes)
    assert ends.keep(upd("a", 1, 1.0)) and ends.keep(upd("a", 2, 2.0))  # the newer replaces
    assert ends.keep(upd("b", 1, 3.0))
    assert not ends.keep(upd("c", 1, 4.0))  # over the budget: not kept
    assert ends.nbytes == 16 and set(ends.kept) == {"a", "b"}
    assert [u.seq for u in ends.carry(0, present={"b"}, active={"a", "b", "c"}).values()] == [2]
    assert ends.carry(0, present=set(), active={"b"}).keys() == {"b"}  # active clients only
    assert ends.carry(1, present=set(), active={"a", "b"}) == {}  # another task's updates
    ends.forget_tasks(0)
    assert ends.kept == {} and ends.nbytes == 0


def two_devices(**over) -> Aggregator:
    fed = FedConfig(**{"mode": "async", "clients": 2, "min_clients": 2, "burn_in": 0,
                       "jump": 1, "round_timeout": 1e9, "mix": 0.5, **over})
    a = Aggregator({"w": np.zeros(2, np.float32)}, fed, batch_size=10)
    for c in ("a", "b"):
        a.join(c, 0.0)
    return a


def test_the_gate_round_carries_an_end_of_task_update_an_earlier_round_counted():
    """b's end-of-task update (4) was counted in v1 = 0.5 * 0 + 0.5 * (2 + 4) / 2 = 1.5, before a
    finished the task (6). The gate's round holds both: 0.5 * 1.5 + 0.5 * (6 + 4) / 2 = 3.25;
    b's update is reported as carried, not counted again."""
    a = two_devices()
    a.submit(upd("a", 1, 2.0), 0.0)
    first = a.submit(upd("b", 1, 4.0), 0.0)
    assert first is not None and np.allclose(first.global_.tensors["w"], 1.5)
    a.submit(upd("a", 2, 6.0, base=1), 0.0)
    assert a.finish_task("a", 0, 0.0) is None
    gate = a.finish_task("b", 0, 0.0)
    assert gate is not None and gate.global_ is not None
    assert np.allclose(gate.global_.tensors["w"], 3.25)
    assert gate.seqs == {"a": 2} and gate.carried == {"b": 1}
    assert gate.global_.counted == {"a": 2, "b": 1}  # what each device's merge goes by
    assert gate.participants == ("a", "b") and a.counters["carried"] == 1
    assert a.task_ends.kept == {}  # the task is passed


def test_without_the_carry_the_same_gate_closes_no_round():
    a = two_devices(gate_carry_mib=0.0)
    a.submit(upd("a", 1, 2.0), 0.0)
    a.submit(upd("b", 1, 4.0), 0.0)
    a.submit(upd("a", 2, 6.0, base=1), 0.0)
    a.finish_task("a", 0, 0.0)
    assert a.finish_task("b", 0, 0.0) is None and a.rounds == 1


def test_a_device_never_has_two_entries_and_no_update_is_counted_twice():
    """b's newer update is in the open round: its kept one is not carried beside it. Over the
    rounds, no (client, seq) is counted twice."""
    a = two_devices()
    counted: list[tuple[str, int]] = []
    for closed in (a.submit(upd("a", 1, 2.0), 0.0), a.submit(upd("b", 1, 4.0), 0.0),
                   a.submit(upd("b", 2, 8.0, base=1), 0.0), a.submit(upd("a", 2, 6.0, base=1),
                                                                   0.0),
                   a.submit(upd("a", 3, 6.0, base=2), 0.0), a.finish_task("a", 0, 0.0),
                   a.finish_task("b", 0, 0.0)):
        if closed is not None and closed.global_ is not None:
            counted += closed.seqs.items()
            assert not set(closed.seqs) & set(closed.carried)
    assert len(counted) == len(set(counted)) == 5


def test_a_gate_round_that_cannot_close_leaves_the_open_round_as_it_was():
    """The quorum is not met even with the carried update (a third device finished nothing
    and left): the open round keeps only what was sent to it."""
    a = two_devices(min_clients=3, clients=3)
    a.join("c", 0.0)
    a.submit(upd("a", 1, 2.0), 0.0)
    a.finish_task("a", 0, 0.0)
    a.finish_task("b", 0, 0.0)
    assert a.leave("c", 0.0) is None and a.rounds == 0
    assert set(a._round.updates) == {"a"} and a._round.carried == {}
    assert a.counters["carried"] == 0


def test_nothing_is_carried_into_a_round_with_nothing_new_or_from_another_task():
    """Every end-of-task update was counted already: the current global holds them, and the
    gate closes no round of carried updates alone. At the next gate, b's kept update of
    task 0 is not carried beside a's of task 1."""
    a = two_devices()
    a.submit(upd("a", 1, 2.0), 0.0)
    a.submit(upd("b", 1, 4.0), 0.0)  # v1 counts both end-of-task updates
    a.finish_task("a", 0, 0.0)
    assert a.finish_task("b", 0, 0.0) is None and a.rounds == 1
    a.submit(upd("a", 2, 6.0, task=1, base=1), 0.0)  # b then sends nothing in task 1
    a.task_ends.keep(upd("b", 1, 4.0))  # as if the gate had not forgotten it
    a.finish_task("a", 1, 0.0)
    assert a.finish_task("b", 1, 0.0) is None and a.counters["carried"] == 0


def tiny_fleet(carry: float, seed: int) -> float:
    """The tiny-task fleet of the MQTT tests (2 devices, 2 tasks of about 13 mini-batches)
    on the congested profile; the lowest task-2 accuracy of a device at the end."""
    cfg = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2},
                              "learn": {"memory_size": 40, "local_epochs": 1},
                              "fed": {"clients": 2, "burn_in": 2, "jump": 2, "mode": "async",
                                      "min_clients": 2, "gate_carry_mib": carry},
                              "profile": "congested", "quiet": True})
    return float(simulate(cfg, seed=seed).acc[:, -1, -1].min())


def test_on_a_congested_link_the_carry_keeps_tiny_tasks_from_collapsing():
    """Where an answer takes longer than a task, the gate's round without the carry holds one
    device's end-of-task model, or none, and the last task ends near 0 on a device in most
    runs (docs/async.md). Seeds 0-7, the same for both."""
    without = [tiny_fleet(0.0, s) for s in range(8)]
    with_carry = [tiny_fleet(16.0, s) for s in range(8)]
    collapsed = sum(x < 0.1 for x in without), sum(x < 0.1 for x in with_carry)
    assert collapsed[1] < collapsed[0], (without, with_carry)
    assert np.mean(with_carry) > np.mean(without) + 0.1, (without, with_carry)


def test_one_device_cannot_take_the_carry_budget_of_the_others():
    """The attack (a reviewer helper's): one device's valid update 19x an honest one's, first in,
    took the budget that 8 of 20 honest end-of-task updates needed. An update that does not
    fit now evicts the largest kept updates over a device's share and larger than it; honest
    updates of one size never evict each other."""
    honest = upd("h", 1, 0.0).nbytes
    ends = TaskEnds(budget=4 * honest)  # 4 devices' worth: a share of `honest` among 4
    big = Update("evil", 0, 1, 0, 1, 10, {"w": np.zeros(6, np.float32)})  # 3x an honest one
    assert ends.keep(big, devices=4)
    kept = [ends.keep(upd(c, 1, 1.0), devices=4) for c in "abcd"]
    assert kept == [True] * 4 and "evil" not in ends.kept and ends.evicted == 1
    assert not ends.keep(upd("e", 1, 1.0), devices=4)  # full of shares: no one evicted
    assert not ends.keep(big, devices=4)  # a larger one never evicts a smaller one
    assert set(ends.kept) == set("abcd") and ends.nbytes == 4 * honest and ends.evicted == 1


def test_the_kept_updates_bookkeeping_stays_bounded():
    ends = TaskEnds(budget=1 << 20)
    for i in range(10_000):
        ends.keep(upd(f"c{i % 3}", i + 1, 1.0), devices=3)
    assert len(ends.kept) == 3 and len(ends._largest) <= 2 * 3 + 65
