"""Replay a dataset as live streams: one `stream/<client>` topic per client, paced or as fast
as the clients consume."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import numpy as np

from edgefcl.config import RunConfig
from edgefcl.data.types import Batch
from edgefcl.runtime.bodies import is_int, is_number
from edgefcl.runtime.links import open_link, status_body, topics
from edgefcl.support.errors import UserError
from edgefcl.support.logs import one_line
from edgefcl.transport.codec import Message, encode, encode_batch

log = logging.getLogger("edgefcl.replay")
MAX_REASON = 300
"""Characters of a refusal's reason said (a device's words: escaped, and cut)."""


def _reason(body: dict) -> str:
    """A refusal's reason, escaped and cut to MAX_REASON characters."""
    return one_line(str(body.get("reason", "")))[:MAX_REASON]


class Replayer:
    """Publishes each client's one-pass stream.

    rate > 0: that many mini-batches per second per client. rate == 0: as fast as the clients
    consume, keeping at most `window` batches in flight per client (clients report how many
    they consumed in their status). A client's stream starts once its status says online (so
    its persistent session exists and nothing is lost), and ends with an end-of-stream marker.
    A client that refused to join (its status since this replayer started) is skipped, with a
    warning; the replay stops only when the aggregator or every client refused.
    """

    def __init__(self, cfg: RunConfig, streams: dict[str, Iterator[Batch]], rate: float = 0.0,
                 window: int = 20, wait_online: float = 120.0) -> None:
        self.cfg = cfg
        self.streams = streams
        self.rate = rate
        self.window = window
        self.wait_online = wait_online
        self.topics = topics(cfg.mqtt)
        self.consumed: dict[str, int] = {}
        self.online: set[str] = set()
        self.refused: dict[str, str] = {}  # client -> why it refused to join
        self.aggregator_refused: str | None = None  # why the aggregator refused to start
        self.started = time.time()
        self.cond = threading.Condition()
        self.sent: dict[str, int] = dict.fromkeys(streams, 0)

    def _fresh_refusal(self, body: dict) -> bool:
        """Whether a status says refused since this replayer started (not a stale one, nor one
        dated after now: a sender's clock is its claim, and a refusal retained with a time in
        the future stopped every later replay)."""
        sent = body.get("time", 0.0)
        return body.get("state") == "refused" and is_number(sent) and (
            self.started - 5.0 <= sent <= time.time() + 5.0)

    def _on_aggregator_status(self, topic: str, payload: bytes) -> None:
        body = status_body(payload, self.cfg.mqtt.fleet)
        if body is not None and self._fresh_refusal(body):
            with self.cond:
                self.aggregator_refused = _reason(body)
                self.cond.notify_all()

    def _on_status(self, topic: str, payload: bytes) -> None:
        body = status_body(payload, self.cfg.mqtt.fleet)
        if body is None:
            return
        try:
            cid = self.topics.client_from(topic)
        except ValueError:
            return
        with self.cond:
            if body.get("state") == "online":
                self.online.add(cid)
                self.refused.pop(cid, None)
            elif cid in self.streams and self._fresh_refusal(body):
                self.refused[cid] = _reason(body)
            consumed = body.get("consumed", 0)
            if is_int(consumed):
                self.consumed[cid] = consumed
            self.cond.notify_all()

    def run(self) -> dict[str, int]:
        """Publish every stream to the end; returns batches sent per client."""
        link = open_link(self.cfg.mqtt, f"{self.cfg.mqtt.fleet}-replayer-{time.time_ns()}",
                         clean_start=True)
        for cid in self.streams:  # its own clients only: another device's flood never reaches it
            link.subscribe(self.topics.status(cid), self._on_status)
        link.subscribe(self.topics.aggregator_status, self._on_aggregator_status)
        fleet = self.cfg.mqtt.fleet
        def settled() -> bool:
            return (set(self.streams) <= self.online | set(self.refused)
                    or self.aggregator_refused is not None)

        deadline = time.monotonic() + self.wait_online
        with self.cond:  # said every 10 s: one missing device holds every stream back
            while not (ok := self.cond.wait_for(settled, min(10.0, max(
                    deadline - time.monotonic(), 0.0)))) and time.monotonic() < deadline:
                missing = sorted(set(self.streams) - self.online - set(self.refused))
                log.info("waiting for clients to come online (%d of %d, up to %.0f s more): "
                         "%s", len(self.streams) - len(missing), len(self.streams),
                         deadline - time.monotonic(), ", ".join(missing[:5]))
            refused = dict(sorted(self.refused.items()))
        if self.aggregator_refused is not None:  # said once, not through each device
            link.close()
            raise UserError(f"the aggregator of fleet '{fleet}' refused to start: "
                            f"{self.aggregator_refused}")
        if refused and set(self.streams) <= set(refused):
            link.close()
            cid, why = next(iter(refused.items()))
            raise UserError(f"every client refused to join; "
                            f"{why if why.startswith(cid) else f'{cid}: {why}'}")
        pending = {c: s for c, s in self.streams.items() if c not in refused}
        for cid, why in refused.items():  # one device cannot stop the others' streams
            log.warning("client %s refused to join (%s): its stream is not replayed", cid, why)
        if not self.online:
            link.close()
            raise UserError(f"no client of fleet '{fleet}' came online within "
                            f"{self.wait_online:.0f} s; start the clients (`edgefcl client`) "
                            "and check `edgefcl status`")
        if not ok:
            missing = sorted(set(pending) - self.online)
            log.warning("clients not online after %.0f s, streaming anyway: %s",
                        self.wait_online, ", ".join(missing))
        interval = 1.0 / self.rate if self.rate > 0 else 0.0
        next_at = time.monotonic()
        while pending:
            for cid in list(pending):
                if not self.rate:
                    with self.cond:
                        if self.sent[cid] - self.consumed.get(cid, 0) >= self.window:
                            continue
                batch = next(pending[cid], None)
                topic = self.topics.stream(cid)
                if batch is None:
                    del pending[cid]
                    end = Message("stream", {"client": cid, "x": np.zeros((0,), np.float32),
                                             "y": np.zeros((0,), np.int64), "task": -1,
                                             "index": 0, "end_of_task": True,
                                             "end_of_stream": True})
                    link.publish(topic, encode(end, fleet=fleet, sender="replayer"), wait=True)
                    continue
                link.publish(topic, encode_batch(batch, client=cid, fleet=fleet), qos=1)
                self.sent[cid] += 1
            if self.rate:
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
            else:
                with self.cond:
                    self.cond.wait(0.01)
        link.close()
        log.info("replayed %s", self.sent)
        return self.sent
