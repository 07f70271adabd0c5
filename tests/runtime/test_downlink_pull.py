"""The pull downlink: an async device listens for the whole global only while an update of its
may still be counted, or while it waits for a global (task gate, end of stream)."""

from __future__ import annotations

import pytest

from edgefcl.build import make_client, prepare
from edgefcl.config import FedConfig, RunConfig, apply
from edgefcl.federation.messages import GlobalModel, Update
from edgefcl.federation.versions import PULL_FLEET, pull_downlink
from edgefcl.learn.global_format import global_tensors
from edgefcl.runtime.device_runner import DeviceRunner
from edgefcl.runtime.links import NullLink, topics
from edgefcl.transport.codec import Message, encode


class RecordingLink(NullLink):
    """Records what the device subscribes to and leaves."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def subscribe(self, pattern: str, *a, **k) -> None:
        self.calls.append(("subscribe", pattern))

    def unsubscribe(self, pattern: str) -> None:
        self.calls.append(("unsubscribe", pattern))


@pytest.fixture(scope="module")
def setup():
    cfg = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2}, "quiet": True,
                              "mqtt": {"fleet": "g"}})
    return prepare(cfg, 0)


def runner(setup, pull: bool) -> tuple[DeviceRunner, RecordingLink]:
    cfg = apply(RunConfig(), {"data": {"tasks": 2, "classes_per_task": 2}, "quiet": True,
                              "mqtt": {"fleet": "g"}, "fed": {"mode": "async"}})
    r = DeviceRunner(cfg, make_client(cfg, setup, 0, "fedavg", 0))
    r.link = link = RecordingLink()
    r._on_message(topics(cfg.mqtt).config, encode(
        Message("config", {"mode": "async", "pull_globals": pull}), fleet="g",
        sender="aggregator"))
    return r, link


def send_update(r: DeviceRunner, seq: int, base: int) -> None:
    tensors = global_tensors(r.client.model, r.cfg.fed.encoding)
    r._send(Update(r.cid, base, seq, 0, seq, 10, tensors))


def deliver(r: DeviceRunner, version: int, participants: tuple[str, ...]) -> None:
    g = GlobalModel(version, global_tensors(r.client.model, r.cfg.fed.encoding), participants)
    r._on_message(topics(r.cfg.mqtt).global_, encode(g, fleet="g"))
    r._merge_async()


def test_a_pulling_device_listens_while_its_update_waits_to_be_counted(setup) -> None:
    r, link = runner(setup, pull=True)
    glob = topics(r.cfg.mqtt).global_
    deliver(r, 1, ())  # the retained global at start; nothing sent yet: it stops listening
    assert link.calls == [("unsubscribe", glob)] and not r.listening
    send_update(r, 1, base=1)
    assert link.calls[-1] == ("subscribe", glob) and r.listening
    deliver(r, 2, ("someone",))  # a round without it: it goes on listening
    assert r.listening
    deliver(r, 3, (r.cid,))  # counted: it leaves
    assert link.calls[-1] == ("unsubscribe", glob) and r.unanswered == 0
    send_update(r, 2, base=3)
    stale = 3 + r.cfg.fed.max_staleness + 1
    deliver(r, stale, ("someone",))  # its update is too stale to be counted now: it leaves
    assert r.unanswered == 1 and not r.listening
    r._waiting_global(True)  # the task gate: it listens until the gate's global came
    assert link.calls[-1] == ("subscribe", glob)
    r._waiting_global(False)
    assert link.calls[-1] == ("unsubscribe", glob)
    assert len(link.calls) == 7


def test_a_device_not_asked_to_pull_always_listens(setup) -> None:
    r, link = runner(setup, pull=False)
    deliver(r, 1, ())
    send_update(r, 1, base=1)
    deliver(r, 2, (r.cid,))
    r._waiting_global(True)
    r._waiting_global(False)
    assert link.calls == [] and r.listening


def test_which_fleets_pull() -> None:
    big = FedConfig(mode="async", clients=PULL_FLEET)
    assert pull_downlink(big)
    assert not pull_downlink(FedConfig(mode="async", clients=PULL_FLEET - 1))
    assert pull_downlink(FedConfig(mode="async", clients=3, downlink="pull"))
    assert not pull_downlink(FedConfig(mode="sync", clients=PULL_FLEET, downlink="pull"))
    assert not pull_downlink(FedConfig(mode="async", clients=PULL_FLEET, downlink="dense"))
    # a delta downlink (sparse encoding) keeps every delta: a missed one costs a whole global
    assert not pull_downlink(FedConfig(mode="async", clients=PULL_FLEET, encoding="sparse"))
