"""Fault injection for a fleet: the plan, damaged payloads, and the helpers the launcher uses
to kill devices, cut links, restart the broker and skew clocks.

Damaged payloads come from a tap in the launcher: it subscribes to every device's update
topic and, for a fraction of the updates it sees, publishes a damaged copy on the same topic
(a flipped-bit copy or a truncated one), as a faulty device, gateway or storage would. The
aggregator must reject every one of them; the tap also checks locally that the codec rejects
the copy, so a corruption the digest missed would show up in its counters.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from edgefcl.config import ConfigError, MqttConfig
from edgefcl.runtime.links import open_link, topics
from edgefcl.transport.broker import MosquittoProcess, start_mosquitto
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, CodecError, decode

log = logging.getLogger("firmware_sim.faults")

CORRUPTION_REASONS = ("digest", "malformed", "schema", "kind", "fleet", "dtype", "shape",
                      "nonfinite", "oversized", "sender", "names")
"""Aggregator rejection reasons a damaged payload can produce (everything but duplicate,
stale, not-eligible and the like, which only well-formed updates get)."""


@dataclass
class FaultPlan:
    """Which faults a fleet run injects, and when (as a fraction of the fleet's stream
    consumed, so the plan does not depend on the machine's speed)."""

    kill: float = 0.0
    """Fraction of the devices killed with SIGKILL (whole host processes) and restarted."""
    kill_at: float = 0.3
    kill_down_s: float = 2.0
    broker_restart_at: float = -1.0
    """Progress at which the broker is restarted (negative: never); needs a local Mosquitto."""
    broker_down_s: float = 1.0
    corrupt: float = 0.0
    """Fraction of the updates on the wire that get a damaged copy."""
    cut: float = 0.0
    """Fraction of the devices whose link is cut."""
    cut_at: float = 0.5
    cut_s: float = 3.0
    skew_s: float = 0.0
    """Clock skews are drawn uniformly from [-skew_s, skew_s]."""

    def validate(self) -> None:
        checks = [
            (0 <= self.kill <= 1, "--kill must be a fraction in [0, 1]"),
            (0 <= self.corrupt <= 1, "--corrupt must be a fraction in [0, 1]"),
            (0 <= self.cut <= 1, "--cut must be a fraction in [0, 1]"),
            (0 <= self.kill_at < 1 and 0 <= self.cut_at < 1,
             "--kill-at and --cut-at are fractions of the stream in [0, 1)"),
            (self.broker_restart_at < 1, "--broker-restart-at must be < 1 (negative: never)"),
            (self.kill_down_s >= 0 and self.broker_down_s >= 0 and self.cut_s > 0,
             "fault durations must be >= 0 (--cut-s > 0)"),
            (self.skew_s >= 0, "--skew-s must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def any(self) -> bool:
        return bool(self.kill or self.corrupt or self.cut or self.skew_s
                    or self.broker_restart_at >= 0)


def damage(payload: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A damaged copy of `payload`: 1 to 8 flipped bits anywhere, or a truncation."""
    if len(payload) > 1 and rng.random() < 0.5:
        return payload[:rng.randrange(1, len(payload))], "truncate"
    data = bytearray(payload)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    if bytes(data) == payload:  # an even number of flips of the same bit
        data[0] ^= 1
    return bytes(data), "flip"


def pick(items: list, fraction: float, rng: random.Random) -> list:
    """round(fraction x len) distinct items, chosen with `rng`."""
    n = round(fraction * len(items))
    return rng.sample(items, n) if n else []


def clock_skews(cids: list[str], skew_s: float, rng: random.Random) -> dict[str, float]:
    """A clock offset per device, uniform in [-skew_s, skew_s]."""
    return {cid: rng.uniform(-skew_s, skew_s) if skew_s else 0.0 for cid in cids}


class Corruptor:
    """The tap that publishes damaged copies of a fraction of the updates (see module doc)."""

    def __init__(self, mqtt: MqttConfig, fraction: float, seed: int) -> None:
        self.mqtt = mqtt
        self.fraction = fraction
        self.rng = random.Random(seed)
        self.topics = topics(mqtt)
        self.counters: Counter[str] = Counter()
        self.outbox: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self.paused = threading.Event()
        self.link = open_link(mqtt, f"{mqtt.fleet}-corruptor", clean_start=False)
        self.link.subscribe(self.topics.updates, self._on_update)
        self.worker = threading.Thread(target=self._publish_loop, daemon=True)
        self.worker.start()

    def _on_update(self, topic: str, payload: bytes) -> None:
        try:  # damage only real updates, not our own damaged copies coming back
            decode(payload, self.mqtt.fleet, max_bytes=self.mqtt.max_payload or DEFAULT_MAX_BYTES,
                   require_digest=True)
        except CodecError:
            self.counters["damaged_seen"] += 1
            return
        self.counters["updates_seen"] += 1
        if self.paused.is_set() or self.rng.random() >= self.fraction:
            return
        bad, mode = damage(payload, self.rng)
        try:
            decode(bad, self.mqtt.fleet, max_bytes=self.mqtt.max_payload or DEFAULT_MAX_BYTES,
                   require_digest=True)
            self.counters["undetected"] += 1  # would be aggregated: the check failed
        except CodecError as e:
            self.counters[f"detected_{e.reason}"] += 1
        self.counters[f"mode_{mode}"] += 1
        self.outbox.put((topic, bad))

    def _publish_loop(self) -> None:
        while (item := self.outbox.get()) is not None:
            topic, bad = item
            self.link.publish(topic, bad, qos=1)  # paho queues it across broker restarts
            self.counters["injected"] += 1

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every damaged copy was handed to the MQTT client."""
        deadline = time.monotonic() + timeout
        while not self.outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.outbox.put(None)
        self.worker.join(10)
        self.link.close()


def restart_broker(proc: MosquittoProcess, down_s: float, extra_conf: str) -> MosquittoProcess:
    """Stop Mosquitto (SIGTERM: it saves its persistence file), wait, start it again on the
    same port and configuration directory."""
    proc.stop()
    time.sleep(down_s)
    return start_mosquitto(port=proc.port, config_dir=Path(proc.config_dir),
                           allow_anonymous=True, extra_conf=extra_conf)


def persistence_conf(config_dir: Path) -> str:
    """Mosquitto settings that keep sessions, queued messages and retained messages across a
    restart."""
    return f"persistence true\npersistence_location {config_dir}/\n"
