"""The root of a sharded aggregation: the aggregator daemon (state directory, versions,
schedule, global, config and status) with its rounds built from workers' partials instead of
device updates.

It does not subscribe to device updates (the workers share them); it listens to device
statuses (who is active, who is done), operator control, `partial/<worker>` and the workers'
retained `workers/<worker>` statuses (last will: offline). Partials are taken only from the
worker ids it is given (`--worker-ids`); everything else on those topics is counted and
dropped like any rejected message. A worker's claim on `partial/<worker>` is answered at once
on `grant/<worker>` with the clients its next partial may hold (`ShardRoot.claim`).
Backpressure (async): the root advertises the highest factor its live workers put on their
statuses (runtime/backpressure.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from edgefcl.config import RunConfig
from edgefcl.federation.messages import Tensors
from edgefcl.federation.shard import ShardRoot
from edgefcl.runtime.aggregator_daemon import SENDER, AggregatorDaemon
from edgefcl.runtime.backpressure import REASONS, advertised, spread_advertised
from edgefcl.runtime.links import partial_limits
from edgefcl.transport.codec import CodecError, Message, decode
from edgefcl.transport.partials import decode_worker_message, encode_grant

log = logging.getLogger("edgefcl.aggregator")


class RootDaemon(AggregatorDaemon):
    """AggregatorDaemon running a ShardRoot fed by the workers in `workers`."""

    aggregator_class = ShardRoot
    agg: ShardRoot
    payload_from_model = False

    def __init__(self, cfg: RunConfig, initial: Tensors, state_dir: Path,
                 workers: frozenset[str], **kw) -> None:
        super().__init__(cfg, initial, state_dir, **kw)
        if not workers:
            raise ValueError("a root needs the ids of its workers (--worker-ids)")
        self.workers = frozenset(workers)
        self.spec_shapes = {k: v.shape for k, v in self.agg.global_.tensors.items()}
        self.partial_limits = partial_limits(self.agg.global_.tensors,
                                             self.agg.strategy.weights_by_class,
                                             self.agg.admission.cap)
        self.worker_pressure: dict[str, tuple[float, str]] = {}
        """(backpressure factor, reason) of each live worker, from its status."""
        self.worker_spread = False
        """Whether a worker has asked its devices to spread their sends."""

    def subscriptions(self) -> list[str]:
        t = self.topics
        return [t.statuses, t.control, t.partials, t.worker_statuses]

    def status(self) -> dict:
        return super().status() | {"role": "root", "workers": sorted(self.agg.live_workers),
                                   "deferred": len(self.agg.deferred)}

    def _pressure(self) -> None:
        """The root's own inbox holds partials, whose rate the devices do not set: its factor
        is relayed from the workers' statuses instead (`_relay_pressure`)."""

    def _relay_pressure(self) -> None:
        before, spread = self.backpressure.factor, self.backpressure.spread
        if self.worker_spread:  # a worker's ask, or the fleet's size
            self.backpressure.spread = self.backpressure.enabled
        self.backpressure.spread_for(len(self.agg.active))
        if self.backpressure.relay(self.worker_pressure) != before:
            log.info("backpressure %.2f (%s)", self.backpressure.factor,
                     self.backpressure.reason or "down")
            self._publish_config()
        elif self.backpressure.spread != spread:
            self._publish_config()

    def _charged(self, topic: str) -> str | None:
        """A worker's partial carries its devices' work: charged to no one's CPU share."""
        try:
            self.topics.worker_from(topic)
        except ValueError:
            return super()._charged(topic)
        return None

    def _handle(self, topic: str, payload: bytes | CodecError, admitted: bool = False) -> None:
        try:
            kind, worker = self.topics.worker_from(topic)
        except ValueError:
            return super()._handle(topic, payload, admitted)
        if isinstance(payload, CodecError):
            raise payload
        if worker not in self.workers:
            if kind == "workers":  # a retained status of another run's worker: not an error
                log.debug("status of %s, not one of this root's workers", worker)
                return
            raise CodecError("worker", f"{worker} is not one of this root's workers")
        now = time.monotonic()
        if kind == "workers":
            msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=64 << 10, require_digest=True)
            if not isinstance(msg, Message) or msg.kind != "status" or msg.sender != worker:
                raise CodecError("kind", f"a worker status on {topic} must be {worker}'s status")
            if msg.body.get("state") == "online":
                self.agg.worker_online(worker)
                reason = msg.body.get("backpressure_reason")
                self.worker_pressure[worker] = (
                    advertised(msg.body, self.cfg.fed.max_backpressure),
                    reason if reason in REASONS else "")
                self.worker_spread = self.worker_spread or spread_advertised(msg.body)
            else:
                self.worker_pressure.pop(worker, None)
                self._close_safely(lambda: self.agg.worker_offline(worker, now))
            self._relay_pressure()
            return
        try:
            p = decode_worker_message(payload, self.cfg.mqtt.fleet, self.spec_shapes,
                                      worker=worker, cap=self.agg.admission.cap,
                                      max_bytes=self.max_payload, limits=self.partial_limits)
        except CodecError:  # the round must not wait for what it held: release its grants
            self._close_safely(lambda: self.agg.release_grants(worker, now))
            raise
        self._heard(now)  # a worker's claim or partial: its devices' reports (its periodic
        # status is no input: it kept an --exit-when-done root open after a device died)
        if isinstance(p, tuple):  # a claim: answered at once, before the round may close
            claim, clients = p
            self._publish(self.topics.grant(worker), encode_grant(
                claim, self.agg.claim(worker, clients), fleet=self.cfg.mqtt.fleet,
                sender=SENDER))
            self._close_safely(lambda: self.agg.poll(now))
            return
        self.round_bytes_in += len(payload)
        self.bytes_in[f"worker:{worker}"] = self.bytes_in.get(f"worker:{worker}", 0) + len(
            payload)
        reason = self.agg.merge(p, now)
        if reason is not None:
            log.warning("rejected partial of %s (%d participants): %s", worker,
                        len(p.participants), reason)
            self._close_safely(lambda: self.agg.release_grants(worker, now))
        self._close_safely(lambda: self.agg.poll(now))
