"""An aggregator worker (role `worker`) or site aggregator (role `site`): takes a share of the
device updates, runs the aggregator's boundary checks on them, and sends the root one
partial aggregate every `flush_every` seconds in which it accepted updates: it first claims
the clients it holds, and folds only those the root grants (the others wait for a later
round, so one device in two workers' shares never holds back the others' updates).

- worker: device updates come through the MQTT 5 shared subscription
  `$share/<group>/<root>/<fleet>/update/+`, so each update reaches one worker of the group and
  a worker that dies stops getting any (the broker gives its share to the others). A device
  update must then travel as one MQTT message (no chunks: chunk_size above the update size),
  since the chunks of one payload could go to different workers.
- site: every device update of the site broker (plain subscription; a shared one with
  `share_group`); its partials reach the central root through the site broker's bridge
  (broker/bridge.conf.example), which also brings the root's global and config down.

The worker holds no state: it learns the current global (and the spec it checks updates
against) from the root's retained global, on `upstream` when given (a second connection),
else on the device broker. It follows the run the root's globals name: when a root starts a
new run (its versions start again at 0), the worker starts over on that run's global (it had
kept an earlier run's, newer by version, and rejected every update as stale); and it refuses
to serve a root, seen online, whose mode, encoding, aggregation or wire dtype differ from its
own (`WORKER_KEYS`; its partials would not merge). Its retained `workers/<id>` status says
online, and its last will offline, so the root stops waiting for it when it dies.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import ClassVar

from edgefcl.config import RunConfig
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.federation.shard import ShardWorker
from edgefcl.runtime.backpressure import Backpressure
from edgefcl.runtime.handling import handle_safely
from edgefcl.runtime.heap import freeze_startup_heap
from edgefcl.runtime.inbox import Inbox, sender_of, shed_counters
from edgefcl.runtime.join import differences, fleet_profile
from edgefcl.runtime.links import (
    inbox_budget,
    message_limits,
    open_link,
    size_payload_limit,
    status_body,
    topics,
    update_limits,
    upstream_config,
)
from edgefcl.runtime.threads import stop_on_signals
from edgefcl.runtime.update_quota import RELEASE_EVERY, UpdateQuota
from edgefcl.support.errors import UserError
from edgefcl.transport.bounds import DEFAULT_LIMITS, STATUS_LIMITS
from edgefcl.transport.codec import (
    DEFAULT_MAX_BYTES,
    CodecError,
    Message,
    decode,
    encode,
    peek_seq,
)
from edgefcl.transport.partials import decode_grant, encode_claim, encode_partial
from edgefcl.transport.topics import UPDATE_KINDS
from edgefcl.transport.transport_error import TransportError

log = logging.getLogger("edgefcl.worker")
MAX_AHEAD = 64
"""Clients whose update a worker may hold for a global it has not received yet."""
AHEAD_VERSIONS = 2
"""How far ahead of the worker's global a held update's base may be (the root publishes one
global at a time: a device is at most a version or two ahead of a worker that lags)."""
CLAIM_TIMEOUT = 2.0
"""Seconds after which an unanswered claim is sent again (with a new number)."""
UNANSWERED_S = 10.0
"""Seconds of claims the root has not answered after which the worker says so (once a minute):
a root not started with this worker in its --worker-ids drops every claim and partial."""
WORKER_KEYS = ("mode", "encoding", "aggregation", "wire_dtype")
"""What a worker's configuration must share with its root's (`join.fleet_profile`)."""


class WorkerDaemon:
    """Serve as worker `worker_id` until stopped (SIGTERM/SIGINT or `control` stop)."""

    def __init__(self, cfg: RunConfig, worker_id: str, *, share_group: str = "aggregators",
                 upstream: str = "", flush_every: float = 0.5, status_every: float = 2.0,
                 inbox_bytes: int = 0, exit_when_done: bool = False,
                 role: str = "worker") -> None:
        self.cfg = cfg
        self.role = role  # worker or site: what its status says
        self.exit_when_done = exit_when_done
        self.root_seen_online = False  # a retained "finished" of an earlier run stops nothing
        self.id = worker_id
        self.topics = topics(cfg.mqtt)
        self.topics.worker_status(worker_id)  # validates the id
        self.share_group = share_group
        self.upstream = upstream
        self.flush_every = flush_every
        self.status_every = status_every
        self.inbox_bytes = inbox_bytes
        budget = inbox_bytes or inbox_budget(cfg.mqtt)
        self.quota = UpdateQuota(max_bytes=budget)  # fair service while backpressure is on
        self.inbox = Inbox(max_bytes=budget,
                           sender_of=sender_of(self.topics), rate=cfg.fed.sender_rate,
                           cpu_share=cfg.fed.sender_cpu,
                           over_limit=self.quota.over)
        self.ahead: dict[str, Update] = {}  # updates based on a global not here yet
        self.backpressure = Backpressure.for_fed(cfg.fed)
        self.max_payload = cfg.mqtt.max_payload or DEFAULT_MAX_BYTES
        self.update_limits = DEFAULT_LIMITS  # sized from the model with the first global
        self.stop_event = threading.Event()
        self.agg: ShardWorker | None = None
        self.first_global = threading.Event()
        self.partials_sent = 0
        self.bytes_out = 0
        self.link = self.up = None
        self._latest_global: bytes | None = None
        self._latest_config: dict | None = None
        self.run_id: str | None = None  # the root's run this worker serves (its globals')
        self.refusal: str | None = None
        self._latest_grant: bytes | None = None
        self.claims = 0
        self.claimed_at: float | None = None
        """When the claim numbered `claims` went out, while it waits for its grant."""
        self.unanswered_since: float | None = None  # the first claim since the last grant
        self.unanswered_said = -float("inf")
        self.incarnation = secrets.token_hex(8)  # this process: a status of another is a twin
        self.own_status_seen = False  # before its own, one of another is the retained one
        self.twin_said = -float("inf")

    # -- messages -------------------------------------------------------------------------
    def _seal(self, body: dict) -> bytes:
        return encode(Message("status", body), fleet=self.cfg.mqtt.fleet, sender=self.id)

    def _on_global(self, topic: str, payload: bytes) -> None:
        """Network thread: the newest global waits in one slot, ahead of the queued updates
        (a worker behind on updates must still check them against the root's version)."""
        self._latest_global = payload
        if not self.first_global.is_set():
            try:
                g = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.max_payload,
                           require_digest=True)
            except CodecError as e:
                log.warning("rejected global: %s", e)
                return
            if isinstance(g, GlobalModel):
                self.initial = g
                self.first_global.set()

    def _hold_ahead(self, u: Update) -> None:
        """A device saw a newer global of the root before this worker did: its update waits
        for that global here (the newest per client, at most MAX_AHEAD clients) instead of
        being rejected as `base`; the next global that reaches its base releases it."""
        agg = self.agg
        if u.client not in self.ahead and len(self.ahead) >= MAX_AHEAD:
            agg.counters["rejected_base"] += 1
            return
        old = self.ahead.get(u.client)
        if old is None or u.seq > old.seq:
            self.ahead[u.client] = u
        agg.counters["held_ahead"] += 1

    def _release_ahead(self, now: float) -> None:
        """Submit the held updates whose base the worker now has."""
        version = self.agg.global_.version
        for client in [c for c, u in self.ahead.items() if u.base_version <= version]:
            self.agg.submit(self.ahead.pop(client), now)

    def _size_payloads(self, tensors: Tensors) -> None:
        """Size the payload limit, inbox and pending chunks from the model (`max_payload` 0)."""
        self.max_payload = size_payload_limit(self.cfg, tensors)
        self.update_limits = update_limits(tensors)
        self.inbox.max_bytes = self.inbox_bytes or inbox_budget(self.cfg.mqtt)
        self.link.limit_payload(self.max_payload)

    def _take_global(self) -> None:
        payload, self._latest_global = self._latest_global, None
        if payload is not None:
            self.handle(self.topics.global_, payload)

    def _on_config(self, topic: str, payload: bytes) -> None:
        """Network thread: the root's retained config waits in one slot for the main loop."""
        try:
            msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=64 << 10, require_digest=True,
                         limits=STATUS_LIMITS)
        except CodecError as e:
            log.warning("rejected config: %s", e)
            return
        if isinstance(msg, Message) and msg.kind == "config":
            self._latest_config = msg.body

    def _take_config(self) -> None:
        """Refuse a root this worker does not match, once that root was seen online (the
        retained config of an earlier run refuses nothing: roles start in any order)."""
        body = self._latest_config
        if body is None or not self.root_seen_online:
            return
        self._latest_config = None
        mine = {k: v for k, v in fleet_profile(self.cfg).items() if k in WORKER_KEYS}
        diff = differences(mine, {k: v for k, v in body.items() if k in WORKER_KEYS})
        if diff:
            self.refusal = (f"worker {self.id} does not match fleet '{self.topics.fleet}': "
                            f"{'; '.join(diff)}; use the root's configuration (the same "
                            "--config)")
            self.stop_event.set()

    def _refuse_if_told(self) -> None:
        """Raise the refusal `_take_config` set, after saying it on the retained status (its
        last will is not sent on a clean close: an "online" left there made the root wait for
        this worker at every round)."""
        if self.refusal is None:
            return
        try:
            self.up.publish(self.topics.worker_status(self.id), self._seal(
                {"state": "refused", "reason": self.refusal}), retain=True, wait=True,
                timeout=5.0)
        except TransportError as e:
            log.warning("worker %s: its refusal was not published: %s", self.id, e)
        raise UserError(self.refusal)

    def _serve(self, g: GlobalModel) -> None:
        """Aggregate from global `g` on, for the run it names."""
        self.agg = ShardWorker(g.tensors, self.cfg.fed, g.version,
                               batch_size=self.cfg.data.batch_size, worker=self.id)
        self.run_id = g.run

    def _start_over(self, g: GlobalModel) -> None:
        """Serve the new run of global `g` (the root started one: its versions start again
        at 0); what was held belongs to the last run."""
        self._serve(g)
        self.ahead.clear()
        log.info("worker %s: the root started run %s; on its global, version %d", self.id,
                 str(g.run)[:16], g.version)

    def _on_grant(self, topic: str, payload: bytes) -> None:
        self._latest_grant = payload  # network thread: the main loop takes it

    def claim(self, now: float, empty: bool = False) -> None:
        """Ask the root for the clients whose updates wait here (answered by a grant); with
        `empty`, claim none, which tells the root the last grant was answered with nothing."""
        clients = () if empty else self.agg.claimable()
        if not clients and not empty:
            return
        self.claims += 1
        self.claimed_at = now
        if self.unanswered_since is None:
            self.unanswered_since = now
        elif (now - self.unanswered_since >= UNANSWERED_S
              and now - self.unanswered_said >= 60.0):
            self.unanswered_said = now
            log.warning("worker %s: the root has answered none of its claims for %.0f s; is %s "
                        "in the root's --worker-ids?", self.id, now - self.unanswered_since,
                        self.id)
        self.bytes_out += self.up.publish(self.topics.partial(self.id), encode_claim(
            self.id, self.claims, clients, fleet=self.cfg.mqtt.fleet), qos=1)

    def _take_grant(self) -> None:
        """Flush the granted clients if the root answered the outstanding claim."""
        payload, self._latest_grant = self._latest_grant, None
        if payload is None:
            return
        try:
            claim, granted = decode_grant(payload, self.cfg.mqtt.fleet,
                                          cap=self.agg.admission.cap)
        except CodecError as e:
            self.agg.counters[f"rejected_{e.reason}"] += 1
            log.warning("rejected grant: %s", e)
            return
        self.unanswered_since = None  # the root answers
        if claim != self.claims or self.claimed_at is None:
            return  # the answer to an earlier claim
        self.claimed_at = None
        self.flush(granted, time.monotonic())

    def handle(self, topic: str, payload: bytes | CodecError, admitted: bool = False) -> None:
        """Apply one message; never raises (failures are counted as `rejected_<reason>`). A
        device's, but for taking an update that passed its checks, counts against the
        device's CPU share."""
        own = topic == self.topics.global_  # the root's: no device's
        handle_safely(lambda: self._handle(topic, payload, admitted), topic,
                      None if own else self.inbox.sender_of(topic), self.inbox,
                      self.agg.counters, log)

    def _handle(self, topic: str, payload: bytes | CodecError, admitted: bool = False) -> None:
        if isinstance(payload, CodecError):
            raise payload
        agg = self.agg
        t = self.topics
        if topic == t.global_:
            g = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.max_payload,
                       require_digest=True)
            if not isinstance(g, GlobalModel) or \
                    {k: v.shape for k, v in g.tensors.items()} != agg.spec:
                raise CodecError("global", "a global that does not match the model")
            if g.run is not None and g.run != self.run_id:
                self._start_over(g)
            elif agg.set_global(g):
                self._release_ahead(time.monotonic())
            return
        allowed = t.kinds_on(topic)
        if not allowed:
            raise CodecError("topic", f"no message is accepted on {topic}")
        reports = allowed == UPDATE_KINDS and not admitted  # (a released one was judged)
        peeked = peek_seq(payload) if reports else None
        if reports and not self.quota.admit(t.client_from(topic), (topic, payload),
                                            len(payload), peeked):
            return  # over its pace or fair share under backpressure: refused, or waits
        msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.max_payload,
                     require_digest=True, limits=message_limits(allowed, self.update_limits))
        kind = msg.kind if isinstance(msg, Message) else type(msg).__name__.lower()
        if kind not in allowed:
            raise CodecError("kind", f"a {kind} message on {topic}")
        if reports and isinstance(msg, (Update, Tick)) and not self.quota.paced_once_decoded(
                t.client_from(topic), msg.seq, peeked):
            return
        handler = self._ON_MESSAGE.get(kind)
        if handler is not None:
            getattr(self, handler)(msg, topic, time.monotonic())

    _ON_MESSAGE: ClassVar[dict[str, str]] = {
        "update": "_on_report", "tick": "_on_report", "status": "_on_status",
        "control": "_on_control"}
    """Kind -> the method that handles it (the global comes on its own topic, before)."""

    def _on_report(self, msg: Update | Tick, topic: str, now: float) -> None:
        """A device's update or tick, from its own topic: held when it is ahead of this
        worker's global (the root's versions decide), else submitted."""
        agg = self.agg
        if msg.client != self.topics.client_from(topic):
            agg.counters["rejected_sender"] += 1
            return
        if (isinstance(msg, Update)
                and 0 < msg.base_version - agg.global_.version <= AHEAD_VERSIONS
                and agg.admission.may_join(msg.client)):
            self._hold_ahead(msg)
            return
        if agg.rejects(msg):  # the checks: charged to the device, as its decoding
            return
        with self.inbox.uncharged():  # the fleet's work (a spill folds many devices')
            agg.take(msg, now)

    def _on_status(self, msg: Message, topic: str, now: float) -> None:
        """A device's status: an online roster device's new incarnation restarts its
        sequence numbers."""
        if topic == self.topics.control:
            return
        client, body = self.topics.client_from(topic), msg.body
        inc = body.get("incarnation")
        if (body.get("state") == "online" and isinstance(inc, str) and 0 < len(inc) <= 64
                and self.agg.admission.admit(client)):  # bounded: roster clients only
            self.agg.admission.session(client, inc)

    def _on_own_status(self, topic: str, payload: bytes) -> None:
        """A status on this worker's own topic from another process, after its own came back
        (before, it is the retained one of the process it replaces): a second worker with
        this id (the broker hands the session back and forth), said once a minute."""
        body = status_body(payload, self.cfg.mqtt.fleet) or {}
        inc = body.get("incarnation")
        if inc == self.incarnation:
            self.own_status_seen = True
            return
        now = time.monotonic()
        if (self.own_status_seen and body.get("state") == "online" and isinstance(inc, str)
                and now - self.twin_said >= 60.0):
            self.twin_said = now
            log.error("worker %s: another worker process runs with this id (incarnation %s): "
                      "give each worker its own --id", self.id, inc[:16])

    def _on_root_status(self, topic: str, payload: bytes) -> None:
        """The root's retained status: with `exit_when_done`, the worker stops once the root
        it saw online says its run finished (a root stopped for a restart says nothing of
        the kind)."""
        body = status_body(payload, self.cfg.mqtt.fleet) or {}
        state = body.get("state")
        if state == "online":
            self.root_seen_online = True
        elif (self.exit_when_done and self.root_seen_online and state == "stopped"
              and body.get("finished") is True):
            log.info("worker %s: the root's run finished; stopping", self.id)
            self.stop_event.set()

    def _on_control(self, msg: Message, topic: str, now: float) -> None:
        """The operator's stop ends the worker."""
        if msg.body.get("command") == "stop":
            self.stop_event.set()

    def flush(self, granted: list[str] | None = None, now: float | None = None) -> None:
        """Send the partial of the updates held (of the `granted` clients only, when given),
        if any. A flush that fails (a bug reached by input) drops them, counted and logged:
        the worker goes on."""
        try:
            p = self.agg.flush(granted, now)
        except Exception:
            self.agg.counters["rejected_internal"] += 1
            log.exception("internal error while aggregating a partial: its updates are dropped")
            self.agg.drop_round()
            p = None
        if p is None:
            if granted:  # every granted update dropped here: the root must not wait for them
                self.claim(time.monotonic(), empty=True)
            return
        payload = encode_partial(p, fleet=self.cfg.mqtt.fleet)
        self.bytes_out += self.up.publish(self.topics.partial(self.id), payload, qos=1)
        self.partials_sent += 1
        log.info("partial %d: %d updates at version %d (%d bytes)", self.partials_sent,
                 len(p.participants), p.version, len(payload))

    def status(self) -> dict:
        a = self.agg
        return {"state": "online", "role": self.role, "incarnation": self.incarnation,
                "version": a.global_.version if a else -1,
                "partials": self.partials_sent, "pending": a.pending() if a else 0,
                "counters": (dict(a.counters) if a else {}) | shed_counters(self.inbox),
                "flooding": dict((self.inbox.offenders + self.quota.shed).most_common(5)),
                "bytes_out": self.bytes_out} | self.backpressure.fields() | self.quota.fields()

    def _pressure(self) -> None:
        """Update the backpressure factor from the inbox's last interval (the root relays the
        highest of its workers' factors to the devices)."""
        line = self.backpressure.observe(self.inbox.load().less(self.quota.refused),
                                         self.status_every, self.quota.rise)
        refused = self.inbox.take_refused()
        recent = self.quota.recent() | set(refused)
        self.backpressure.spread_for(len(recent))
        limit = self.quota.end_interval(self.status_every, recent, self.backpressure.factor,
                                        refused)
        for said in (line, limit):
            if said:
                log.info(said)

    # -- main loop ------------------------------------------------------------------------
    def _connect(self) -> None:
        m, t = self.cfg.mqtt, self.topics
        will = (t.worker_status(self.id), self._seal({"state": "offline"}), 1, True)
        cid = f"{m.fleet}-worker-{self.id}"
        # clean start: a dead worker leaves no session holding updates for it
        self.link = open_link(m, cid, clean_start=True, protocol="5", on_reject=self.inbox.put,
                              will=None if self.upstream else will)
        self.up = self.link
        if self.upstream:
            self.up = open_link(upstream_config(m, self.upstream), cid + "-up", clean_start=True,
                                will=will, password_variable=None)
        self.up.subscribe(t.config, self._on_config)
        self.up.subscribe(t.global_, self._on_global)
        self.up.subscribe(t.grant(self.id), self._on_grant)
        self.up.subscribe(t.aggregator_status, self._on_root_status)
        self.up.subscribe(t.worker_status(self.id), self._on_own_status)
        if not self.first_global.wait(m.connect_timeout):
            raise TransportError(f"no global model on {t.global_} within {m.connect_timeout:g} s: "
                                 "start the root aggregator first (--role root)")

    def run(self) -> int:
        stop_on_signals(self.stop_event)
        try:
            self._connect()
            g = self.initial
            self._size_payloads(g.tensors)
            self._serve(g)
            self._take_config()
            self._refuse_if_told()
            t, put = self.topics, self.inbox.put
            updates = t.shared(t.updates, self.share_group) if self.share_group else t.updates
            self.link.subscribe(updates, put)
            self.link.subscribe(t.statuses, put)
            self.up.subscribe(t.control, put)
            self.up.publish(t.worker_status(self.id), self._seal(self.status()), retain=True)
            log.info("worker %s for fleet %s on %s (%s), version %d", self.id, t.fleet,
                     self.cfg.mqtt.broker, updates, g.version)
            freeze_startup_heap()
            next_status = next_release = 0.0
            while not self.stop_event.is_set():
                self._take_config()
                self._take_global()
                self._take_grant()
                item = self.inbox.get(timeout=0.05)
                if item is not None:
                    self.handle(*item)
                now = time.monotonic()
                if now >= next_release:  # what waited for its device's token
                    for topic, payload in self.quota.release():
                        self.handle(topic, payload, admitted=True)
                    next_release = now + RELEASE_EVERY
                if self.agg.flush_due(now, self.flush_every) and (
                        self.claimed_at is None or now - self.claimed_at >= CLAIM_TIMEOUT):
                    self.claim(now)
                self.link.expire_pending()
                if now >= next_status:
                    self._pressure()
                    self.up.publish(t.worker_status(self.id), self._seal(self.status()),
                                    retain=True)
                    next_status = now + self.status_every
            self._refuse_if_told()  # the root changed to settings this worker lacks
            self.flush()
            self.up.publish(t.worker_status(self.id), self._seal({"state": "stopped"}),
                            retain=True, wait=True, timeout=5.0)
        finally:
            for link in {id(x): x for x in (self.link, self.up) if x is not None}.values():
                link.close()
        log.info("worker %s stopped after %d partials", self.id, self.partials_sent)
        return 0
