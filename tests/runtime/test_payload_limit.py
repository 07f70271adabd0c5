"""The payload limit sized from the model (`[mqtt] max_payload = 0`, the default): what one
sender can make a daemon or a device hold is bounded by the model, not by a fixed 64 MiB."""

from __future__ import annotations

import numpy as np

from edgefcl.config import RunConfig, apply
from edgefcl.runtime.aggregator_daemon import AggregatorDaemon
from edgefcl.runtime.links import inbox_budget, payload_limit
from edgefcl.transport.codec import Message, encode

FLEET = "limits"
TENSORS = {"fc.weight": np.zeros((10, 20), np.float32), "fc.bias": np.zeros(10, np.float32)}
MODEL = 4 * (200 + 10)  # float32 bytes
MIB = 1 << 20


def cfg(**sections) -> RunConfig:
    return apply(RunConfig(), {"quiet": True, "mqtt": {"fleet": FLEET}, **sections})


def test_limit_sized_from_the_model_by_hand() -> None:
    assert payload_limit(cfg(learn={"method": "bi"}), TENSORS) == 4 * MODEL + MIB
    # apc: the knowledge base holds apc_kb_size copies of the model
    assert payload_limit(cfg(learn={"method": "apc"}, fed={"apc_kb_size": 5}),
                         TENSORS) == 4 * MODEL + 5 * MODEL + MIB
    # prototypes: 1,024 labels x (rows and variances of width 10 + 1, names, counts)
    library = 1024 * (2 * 4 * 11 + 4 * 64 + 16)
    assert payload_limit(cfg(learn={"method": "bi", "head": "prototypes"}),
                         TENSORS) == 4 * MODEL + library + MIB


def test_explicit_limit_wins_and_inbox_has_a_floor() -> None:
    c = cfg(mqtt={"fleet": FLEET, "max_payload": 123456})
    assert payload_limit(c, TENSORS) == 123456
    assert inbox_budget(c.mqtt) == 32 * MIB
    assert inbox_budget(cfg(mqtt={"fleet": FLEET, "max_payload": 64 * MIB}).mqtt) == 256 * MIB


class Sink:
    def publish(self, topic, payload, qos=1, retain=False, wait=False) -> int:
        return len(payload)


def test_daemon_refuses_a_payload_larger_than_its_model_allows(tmp_path) -> None:
    c = cfg(fed={"clients": 2, "burn_in": 0, "jump": 1, "mode": "async"})
    d = AggregatorDaemon(c, TENSORS, tmp_path / "state")
    d.link = Sink()
    assert d.max_payload == c.mqtt.max_payload == 4 * MODEL + MIB
    assert d.inbox.max_bytes == 32 * MIB
    big = encode(Message("status", {"state": "online", "pad": "x" * (2 * MIB)}, sender="a"),
                 fleet=FLEET)
    d.handle(d.topics.status("a"), big)
    assert d.agg.counters["rejected_oversized"] == 1
    d.store.close()
