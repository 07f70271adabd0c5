"""A device: the online Client fed by a stream (MQTT `stream/<id>` or a local source),
publishing updates and merging globals over MQTT."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from edgefcl.config import RunConfig
from edgefcl.data.types import Batch, TaskData
from edgefcl.federation.global_check import MAX_VERSION_STEP, check_global
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.federation.sparse import SparseError
from edgefcl.federation.task_gate import MAX_TASK, gate_open
from edgefcl.federation.versions import (
    DELTA_FROM,
    DownlinkState,
    apply_global_delta,
    delta_downlink,
)
from edgefcl.learn.client import Client
from edgefcl.learn.drift import stream_report
from edgefcl.learn.global_format import global_tensors
from edgefcl.learn.merges import CAUGHT_UP, MERGED, merge_at_gate, merge_global, rejoin
from edgefcl.outcomes.metrics import forgetting
from edgefcl.runtime.backpressure import Pacer, advertised, spread_advertised
from edgefcl.runtime.bodies import body_fault, is_number
from edgefcl.runtime.join import JoinRefused, check_join
from edgefcl.runtime.links import open_link, size_payload_limit, topics, wire_dtype
from edgefcl.support.errors import UserError
from edgefcl.support.statefiles import save_json
from edgefcl.transport.codec import CodecError, Message, as_batch, decode, encode, tensor_spec

log = logging.getLogger("edgefcl.client")

END = object()
MAX_ARRIVALS = 256
"""Global versions whose arrival time a device keeps for its results (bounded)."""
GLOBAL_FETCHES = 3
"""Times a lock-step device fetches the whole global for an answered version that has not come
before it goes on without it (each after `answer_timeout` s)."""
OLDER_GLOBALS = 3
"""Globals in a row, each newer than the last, all older than the version a device holds,
after which it takes the newest whole (`rejoin`): that version was not its aggregator's."""
REFETCH_S = 5.0
"""Seconds between two fetches of the whole global that deltas missing a change set off (a
forged 150-byte delta made the broker send the whole global down the link each time); one
asked for sooner is made when they have passed."""


class Stopped(Exception):
    """The operator sent `stop`, or the process was asked to terminate."""


class _Later:
    """A send that goes out once: when its timer fires or when flushed, whichever is first."""

    def __init__(self, send) -> None:
        self.send = send
        self.lock = threading.Lock()
        self.done = False

    def fire(self) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                self.send()

    def cancel(self) -> None:
        with self.lock:
            self.done = True


class DeviceRunner:
    """Drives one Client over MQTT.

    sync: after every mini-batch the device reports (update or tick) and waits for the
    aggregator's answer for that tick, then merges the global if it took part (Algorithm 1).
    async: the device never waits; a global it took part in is merged with the delta rule
    theta_global + (theta_now - theta_sent) before the next mini-batch. An update carries the
    whole model, so the last one sent carries all the device learned: when another aggregator
    process comes up (a restart loses the updates the old one held) it is sent again, and at
    the end of the stream the device waits for a round that counts it (`_last_round`).

    Hooks for a device built on this runner (firmware_sim.Firmware: flash, radio, compute
    budget), no-ops here: `admit_stream`, `check_alive`, `on_idle`, `before_stream`,
    `before_batch`, `after_batch`, `after_stream`, `send_update`, `send_last`, `status_fields`,
    `final_status`, `result_fields` and `after_run`.
    """

    def __init__(self, cfg: RunConfig, client: Client, source: Iterator[Batch] | None = None,
                 eval_tasks: list[TaskData] | None = None, out: Path | None = None,
                 status_every: int = 5, answer_timeout: float = 15.0) -> None:
        self.cfg = cfg
        self.client = client
        self.cid = client.cid
        size_payload_limit(cfg, client.base)  # before any link opens
        self.topics = topics(cfg.mqtt)
        self.source = source
        self.eval_tasks = eval_tasks
        self.out = out
        self.status_every = status_every
        self.answer_timeout = answer_timeout
        self.batches: queue.Queue = queue.Queue()
        self.answers: dict[int, dict] = {}  # the awaited tick's answer, once it came
        self.awaited_tick: int | None = None
        self.fleet_tick = 0
        """The latest tick an answer named (only the aggregator may publish answers)."""
        self.refetched_at = float("-inf")  # when a delta that missed a change last fetched
        self.refetch_pending = False  # one asked for within REFETCH_S of the last
        self.older_globals = 0  # globals in a row, rising, below the version held
        self.version_resets = 0
        self.latest: GlobalModel | None = None
        # sparse downlink: this device's copy of the global, which the deltas update
        self.tracker = (DownlinkState(client.base, client.version)
                        if delta_downlink(cfg.fed) else None)
        self.cond = threading.Condition()
        self.paused = False
        self.stop = threading.Event()
        self.consumed = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.rounds = 0
        self.catch_ups = 0  # globals merged without taking part (see _merge_async)
        self.unanswered = 0  # async: updates sent since the last global that listed this device
        self.pull = False
        """Async, whole globals: the aggregator asks its fleet to pull (`pull_globals`): the
        device listens for globals only while an update of its may still be counted, or while
        it waits for one (`_wants_global`)."""
        self.listening = True  # not left by pulling (a delta-downlink device never pulls)
        self.waiting_global = False  # at the task gate or the end of the stream
        self.last_update: tuple[int, int, bytes, str | None] | None = None
        """async: the last update sent (seq, base version, payload, the incarnation of the
        aggregator it was sent to, from its retained config)."""
        self.rejected = 0
        self.duplicates = 0
        # the matched timing profile of an MQTT run reads these (`edgefcl.sim.profiles`)
        self.first_batch: float | None = None  # monotonic time of the first mini-batch
        self.last_batch = 0.0
        self.first_batch_at = 0.0  # and its wall time (devices start apart)
        self.stream_s = 0.0  # from the first mini-batch to the end of the stream
        self.batch_s: list[float] = []  # each mini-batch's time, start to start
        self.arrivals: dict[int, float] = {}  # global version -> wall time it arrived
        # every global is checked against this device's own model before it is adopted
        self.global_spec = tensor_spec(global_tensors(client.model, cfg.fed.encoding))
        protos = client.protos  # head prototypes with a shared library: rows of its width
        self.library_width = (protos.library.dim + 1 if protos is not None and protos.share
                              else None)
        self.library_gaussian = protos.library.gaussian if protos is not None else False
        self.rejections: Counter[str] = Counter()
        # this installation's session: its sequence numbers start at 1 (kept on flash by
        # devices that resume their sequence numbers, see firmware_sim)
        self.incarnation = secrets.token_hex(8)
        self.born = time.time()  # a status of another process on this id, sent since: a twin
        self.twin_said = -float("inf")  # when a twin was last logged
        n_tasks = len(eval_tasks) if eval_tasks else 0
        self.acc = np.full((n_tasks, n_tasks), np.nan)
        self.coverage = np.zeros((2, n_tasks), np.int64)  # prototypes (see simulate)
        self.link = None
        # join check (runtime/join.py): this device's profile against the retained config
        self.join_profile: dict | None = None
        self.fleet_config: dict | None = None
        self.aggregator_state: dict | None = None
        self.join_timeout = 60.0
        self.started = time.time()  # an aggregator refusal older than this is from a past run
        # async: the aggregator's backpressure (retained config, and its status while this
        # device follows it) stretches the jump: one due update in `factor` is sent
        self.pacer = Pacer(self.cid, cfg.seed)
        self._sends: list[_Later] = []  # async updates waiting for their send delay
        if cfg.fed.mode == "async":
            client.pace = self._pace
        self.finished_task = MAX_TASK if cfg.learn.task_free else -1
        """async: the last task this device finished (its status claims it: the task gate). A
        task-free device does not know where a task ends: it never waits at the gate, and
        claims every task so that it never holds the others there."""
        self.last_task: int | None = None
        self.gate_waits = 0.0  # seconds waited at the task gate
        self.gate_timeouts = 0

    # -- inbound --------------------------------------------------------------------------
    def _on_message(self, topic: str, payload: bytes) -> None:
        """Handle one message; never raises: every failure is logged and counted."""
        if topic == self.topics.stream(self.cid) and not self.admit_stream(payload):
            return
        try:
            self._handle(topic, payload)
        except CodecError as e:
            self._reject(topic, e.reason, str(e))
        except Exception as e:  # a bug reached by input: counted, the device goes on
            self._reject(topic, "internal", repr(e))
            log.exception("%s: internal error on %s", self.cid, topic)

    def _reject(self, topic: str, reason: str, detail: str) -> None:
        self.rejected += 1
        self.rejections[reason] += 1
        log.warning("%s: rejected payload on %s: %s", self.cid, topic, detail)

    def _handle(self, topic: str, payload: bytes) -> None:
        tp = self.topics
        allowed = {tp.global_: "global", tp.global_delta: "global", tp.tick: "answer",
                   tp.control: "control", tp.stream(self.cid): "stream", tp.config: "config",
                   tp.aggregator_status: "status", tp.status(self.cid): "status"}.get(topic)
        if allowed is None:
            raise CodecError("topic", f"no message is accepted on {topic}")
        msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.cfg.mqtt.max_payload,
                     require_digest=True)
        kind = msg.kind if isinstance(msg, Message) else type(msg).__name__.lower()
        if kind.replace("globalmodel", "global") != allowed:
            raise CodecError("kind", f"a {kind} message on {topic}")
        fault = body_fault(kind, msg.body) if isinstance(msg, Message) else None
        if fault is not None:
            raise CodecError("malformed", fault)
        if kind == "answer" and msg.body["version"] - self.client.version > MAX_VERSION_STEP:
            raise CodecError("version-jump", f"an answer names version {msg.body['version']}")
        if topic == tp.status(self.cid):
            self._on_own_status(msg.body)
            return
        with self.cond:
            if isinstance(msg, GlobalModel):
                self.bytes_down += len(payload)
                self._on_global(topic, msg)
            else:  # a map kind its topic admits (checked above)
                getattr(self, self._ON_MESSAGE[msg.kind])(msg)
            self.cond.notify_all()

    def _on_own_status(self, body: dict) -> None:
        """A status on this device's own topic: another process's, sent since this one
        started, is a twin on the same id (the broker hands the session back and forth and
        their streams and updates mix): said once a minute."""
        inc, sent = body.get("incarnation"), body.get("time")
        if inc is None or inc == self.incarnation or not is_number(sent) or \
                sent < self.born or body.get("state") == "offline":
            return
        self.rejections["twin"] += 1
        if time.monotonic() - self.twin_said >= 60:
            self.twin_said = time.monotonic()
            log.error("%s: another device process runs with this id (its statuses come from "
                      "incarnation %s): give each device its own --index or --id", self.cid,
                      str(inc)[:16])

    # -- what each map kind does (under self.cond) ---------------------------------------------
    def _on_config(self, msg: Message) -> None:
        """The aggregator's retained config: the fleet's settings, the gate, the pacing."""
        self.fleet_config = msg.body
        self.pull = (msg.body.get("pull_globals") is True and self.tracker is None
                     and self.cfg.fed.mode == "async")
        self._follow_pacing(msg.body)

    def _on_aggregator_status(self, msg: Message) -> None:
        """The aggregator's status: its state and, under load, the backpressure factor."""
        self.aggregator_state = msg.body
        if "backpressure" in msg.body:
            self._follow_pacing(msg.body)

    def _follow_pacing(self, body: dict) -> None:
        """Take the backpressure factor and spreading the aggregator advertises."""
        self.pacer.factor = advertised(body, self.cfg.fed.max_backpressure)
        self.pacer.spreading = spread_advertised(body)

    def _on_answer(self, msg: Message) -> None:
        """A lock-step tick's answer, kept only for the tick this device waits on: every
        answer was kept, and forged ones for other ticks held 405 MiB in a device. The latest
        tick answered is noted (`fleet_tick`): a device whose tick the fleet has passed is
        out of step (`_sync_round`)."""
        self.fleet_tick = max(self.fleet_tick, msg.body["tick"])
        if msg.body["tick"] == self.awaited_tick:
            self.answers[msg.body["tick"]] = msg.body

    def _on_control(self, msg: Message) -> None:
        """The operator's pause, resume or stop."""
        cmd = msg.body["command"]
        self.paused = cmd == "pause"
        if cmd == "stop":
            self.stop.set()

    def _on_stream(self, msg: Message) -> None:
        """A mini-batch of this device's replayed stream, or its end."""
        self.batches.put(END if msg.body.get("end_of_stream") else as_batch(msg))

    _ON_MESSAGE: ClassVar[dict[str, str]] = {
        "config": "_on_config", "status": "_on_aggregator_status", "answer": "_on_answer",
        "control": "_on_control", "stream": "_on_stream"}
    """Map kind -> the method that handles it; `_on_message`'s topics admit no other."""

    def _on_global(self, topic: str, g: GlobalModel) -> None:
        """A whole global (the retained one) or, with a sparse downlink, the change from the
        previous version, applied to this device's copy of the global (under self.cond)."""
        if self.tracker is None:
            self._check(g)
            self._adopt(g)  # the retained global: the newest the aggregator published
        elif topic == self.topics.global_delta:
            frm = g.tensors.get(DELTA_FROM)
            if frm is not None and frm.shape == () and int(frm) == self.tracker.version:
                try:
                    whole = apply_global_delta(g.tensors, self.tracker.tensors)
                except SparseError as e:
                    raise CodecError("delta", str(e)) from None
                g = replace(g, tensors=whole)
                self._check(g)
                self.tracker = DownlinkState(g.tensors, g.version)
                self._adopt(g)
            else:  # missed a change (reboot, resumed aggregator): the whole global, soon
                self.refetch_pending = True
                self._refetch_if_due()
        else:
            self._check(g)
            self.tracker = DownlinkState(g.tensors, g.version)
            self._adopt(g)
            self.refetch_pending = False
            self.link.unsubscribe(self.topics.global_)  # back on deltas only

    def _adopt(self, g: GlobalModel) -> None:
        """Keep `g` as the newest global (checked); note when it arrived (the first
        `MAX_ARRIVALS` versions: the matched timing profile reads the delays) and how many
        globals in a row, each newer than the last, were older than the version held."""
        if g.version >= self.client.version:
            self.older_globals = 0
        elif self.older_globals == 0 or (self.latest is not None
                                         and g.version > self.latest.version):
            self.older_globals += 1
        if (len(self.arrivals) < MAX_ARRIVALS and g.version not in self.arrivals
                and (self.latest is None or g.version > self.latest.version)):
            self.arrivals[g.version] = time.time()
        self.latest = g

    def _check(self, g: GlobalModel) -> None:
        """Raise CodecError(reason) unless `g` fits this device's model (never adopted)."""
        reason = check_global(g, self.global_spec, self.client.version,
                              library_width=self.library_width,
                              library_gaussian=self.library_gaussian, previous=self.latest,
                              clip_factor=self.cfg.fed.clip_factor)
        if reason is not None:
            raise CodecError(reason, f"global v{g.version} does not fit this device's model")

    def _refetch_if_due(self) -> None:
        """Fetch the whole global a delta that missed a change asked for, at most every
        REFETCH_S: each fetch is a whole global down the link, and forged 150-byte deltas set
        one off each; one asked for sooner waits (the device's waits and merges call this)."""
        if self.refetch_pending and time.monotonic() - self.refetched_at >= REFETCH_S:
            self.refetch_pending = False
            self.refetched_at = time.monotonic()
            self._fetch_whole()

    def _fetch_whole(self) -> None:
        """(Re)subscribe to the retained whole global, which the broker then delivers: a
        sparse-downlink device that missed a change, or a global lost at QoS 0."""
        log.info("%s: fetching the whole global", self.cid)
        self.link.unsubscribe(self.topics.global_)
        self.link.subscribe(self.topics.global_, self._on_message, qos=0, wait=False)

    def _wants_global(self) -> bool:
        """Whether the device listens for globals now: always, unless it pulls; then while
        it waits for one (task gate, end of stream) or its last update may still be counted
        (not answered, and not staler than `max_staleness` against the newest global)."""
        if not self.pull or self.waiting_global:
            return True
        if not self.unanswered or self.last_update is None:
            return False
        latest = self.latest
        return latest is None or latest.version - self.last_update[1] <= self.cfg.fed.max_staleness

    def _listen(self) -> None:
        """Subscribe to the whole global, or leave it, as `_wants_global` says."""
        want = self._wants_global()
        if want != self.listening:
            self.listening = want
            if want:  # the retained global arrives at once, then every new one
                self.link.subscribe(self.topics.global_, self._on_message, qos=0, wait=False)
            else:
                self.link.unsubscribe(self.topics.global_)

    def _waiting_global(self, waiting: bool) -> None:
        """The device starts or stops waiting for a global (it listens meanwhile)."""
        self.waiting_global = waiting
        self._listen()

    def _stream(self) -> Iterator[Batch]:
        if not self.before_stream():
            return
        if self.source is not None:
            yield from self.source
            return
        last = (-1, -1)
        while True:
            item = self._wait(lambda: self._get_batch())
            if item is END:
                return
            if (item.task, item.index) <= last:
                self.duplicates += 1  # a QoS 1 redelivery: each batch is consumed once
                continue
            last = (item.task, item.index)
            yield item

    def _get_batch(self):
        self.on_idle()  # polled every 50 ms while the device waits for data
        try:
            return self.batches.get_nowait()
        except queue.Empty:
            return None

    def _wait(self, ready, timeout: float | None = None, on_timeout=None):
        """Block until ready() returns something not None (or raise Stopped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                if self.stop.is_set():
                    raise Stopped
                self.check_alive()
                self._refetch_if_due()
                value = ready()
                if value is not None:
                    return value
                if deadline is not None and time.monotonic() >= deadline:
                    if on_timeout is not None:
                        on_timeout()
                    deadline = time.monotonic() + timeout
                self.cond.wait(0.05 if deadline is None else
                               max(0.0, min(0.05, deadline - time.monotonic())))

    # -- outbound -------------------------------------------------------------------------
    def _send(self, msg: Update | Tick, last: bool = False) -> bytes:
        payload = encode(msg, fleet=self.cfg.mqtt.fleet, wire_dtype=wire_dtype(self.cfg.mqtt))
        if isinstance(msg, Update):
            (self.send_last if last else self.send_update)(msg.seq, payload)
            self.unanswered += 1
            self.last_update = (msg.seq, msg.base_version, payload, self._aggregator())
            self._listen()
        else:
            self.link.publish(self.topics.update(self.cid), payload, qos=1)
        return payload

    def _status(self, state: str, wait: bool = False, **extra) -> None:
        c = self.client
        body = {"state": state, "incarnation": self.incarnation,
                "task": c.task if c.task is not None else -1, "batch": c.batch_in_task,
                "version": c.version, "consumed": self.consumed, "rounds": self.rounds,
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "rejected": self.rejected, "time": round(time.time(), 3),
                "finished_task": self.finished_task,
                "prequential": self._prequential(), **extra, **self.status_fields()}
        run = (self.fleet_config or {}).get("run")
        if run is not None:  # the run this device reports to
            body["run"] = run
        self.link.publish(self.topics.status(self.cid),
                          encode(Message("status", body), fleet=self.cfg.mqtt.fleet,
                                 sender=self.cid), qos=1, retain=True, wait=wait)

    def _prequential(self) -> float | None:
        monitor = getattr(self.client, "monitor", None)
        preq = getattr(monitor, "prequential", None)
        if preq is None or not preq.samples:
            return None
        return round(100.0 * float(preq.accuracy), 2)

    def _join(self) -> None:
        """Wait for an online aggregator and its retained config; refuse to train on a
        mismatch, or when no aggregator comes online within `join_timeout` s (a device never
        trains alone believing it is part of a fleet)."""
        def waiting() -> None:
            state = (self.aggregator_state or {}).get("state", "not seen")
            log.info("%s: waiting for the aggregator of fleet %s (its status: %s)", self.cid,
                     self.cfg.mqtt.fleet, state)

        def ready():
            agg = self.aggregator_state or {}
            if (agg.get("state") == "refused"
                    and float(agg.get("time", 0.0)) >= self.started - 5.0):
                raise JoinRefused(f"{self.cid}: the aggregator of fleet '{self.cfg.mqtt.fleet}' "
                                  f"refused to start: {agg.get('reason', '')}")
            online = agg.get("state") == "online"
            return self.fleet_config if online and self.fleet_config is not None else None

        deadline = time.monotonic() + self.join_timeout
        fleet = None
        try:
            while fleet is None:
                if time.monotonic() > deadline:
                    last = self.aggregator_state or {}
                    why = f" ({last['reason']})" if last.get("reason") else ""
                    raise JoinRefused(f"{self.cid}: no aggregator of fleet "
                                      f"'{self.cfg.mqtt.fleet}' online on "
                                      f"{self.cfg.mqtt.broker} after "
                                      f"{self.join_timeout:.0f} s; its last status: "
                                      f"{last.get('state', 'none')}{why}")
                fleet = self._wait(lambda: ready() or (False if time.monotonic() > deadline
                                                       else None), 10.0, waiting) or None
            check_join(self.cid, self.cfg.mqtt.fleet, self.join_profile, fleet)
            self.link.unsubscribe(self.topics.aggregator_status)
        except JoinRefused as e:
            self.final_status("refused", reason=str(e))
            self.link.close()
            raise

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> dict:
        """Consume the whole stream; returns this device's results."""
        offline = encode(Message("status", {"state": "offline"}), fleet=self.cfg.mqtt.fleet,
                         sender=self.cid)
        self.link = open_link(self.cfg.mqtt, f"{self.cfg.mqtt.fleet}-{self.cid}",
                              will=(self.topics.status(self.cid), offline, 1, True),
                              connect=False)
        sync = self.cfg.fed.mode == "sync"
        # QoS 0: only the newest global matters. It is retained, so every (re)subscription on
        # (re)connect delivers it; with QoS 1 the broker would queue every global published
        # while the device was offline and replay them all over its (slow) link first.
        if self.tracker is None:
            self.link.subscribe(self.topics.global_, self._on_message, qos=0)
        else:  # sparse downlink: the changes, in order (QoS 1, queued while offline)
            self.link.subscribe(self.topics.global_delta, self._on_message)
        self.link.subscribe(self.topics.tick, self._on_message)
        self.link.subscribe(self.topics.control, self._on_message)
        if self.join_profile is not None or not sync:  # async: backpressure on the config
            self.link.subscribe(self.topics.config, self._on_message)
        if self.join_profile is not None:
            self.link.subscribe(self.topics.aggregator_status, self._on_message)
        if self.source is None:
            self.link.subscribe(self.topics.stream(self.cid), self._on_message)
        self.link.subscribe(self.topics.status(self.cid), self._on_message)  # a twin's
        self.link.connect(self.cfg.mqtt.connect_timeout)
        if self.join_profile is not None:
            self._join()
        self._status("online")
        log.info("%s online on %s (fleet %s, mode %s)", self.cid, self.cfg.mqtt.broker,
                 self.cfg.mqtt.fleet, self.cfg.fed.mode)
        try:
            for batch in self._stream():
                now = time.monotonic()
                if self.first_batch is None:
                    self.first_batch, self.first_batch_at = now, time.time()
                else:
                    self.batch_s.append(now - self.last_batch)
                self.last_batch = now
                self.before_batch(batch)
                self._wait(lambda: True if not self.paused else None)
                upd = self.client.step(batch)
                self.consumed += 1
                if sync:
                    self._sync_round(upd)
                elif upd is not None:
                    self._send(upd)
                if not sync:
                    self._merge_async()
                    self._resend_if_restarted()
                if batch.end_of_task and not sync and self._gated():
                    self._task_gate(batch.task)
                if batch.end_of_task:
                    self.last_task = batch.task
                    self._evaluate(batch.task)
                if self.consumed % self.status_every == 0:
                    self._status("online")
                self.after_batch(batch)
            if self.first_batch is not None:
                self.stream_s = time.monotonic() - self.first_batch
            if not sync:
                final = self.client.held_update()  # the last mini-batches reach the fleet
                if final is not None:
                    self.pacer.pay()
                    self._send(final, last=True)
                self.flush_sends()
                self._last_round()
                if self.last_task is not None:  # again, on the model the device ends with
                    self._evaluate(self.last_task)
            self.after_stream()
            state = "done"
        except Stopped:
            state = "stopped"
            for later in self._sends:  # the link closes: nothing goes out after it
                later.cancel()
        results = self.results()
        self.final_status(state, accuracy=results.get("accuracy"),
                          forgetting=results.get("forgetting"),
                          accuracy_matrix=results["accuracy_matrix"])
        self.link.close()
        if self.out is not None:
            save_json(self.out / f"{self.cid}.json", results)
        self.after_run(state)
        return results

    def _evaluate(self, task: int) -> None:
        """Accuracy on every task's test set after `task` (its row of the matrix)."""
        if not self.eval_tasks:
            return
        self.acc[task] = [self.client.evaluate(t.x_test, t.y_test) for t in self.eval_tasks]
        if self.client.protos is not None:
            self.coverage[:, task] = self.client.protos.coverage(
                [t.y_test for t in self.eval_tasks])

    def _gated(self) -> bool:
        """Whether this device waits at a task's end: `task_gate` on, and the aggregator
        advertises the gate on its retained config."""
        with self.cond:
            return (self.cfg.fed.task_gate > 0 and not self.cfg.learn.task_free
                    and "tasks_passed" in (self.fleet_config or {}))

    def _task_gate(self, task: int) -> None:
        """Async, at the end of `task`: send the held update (the task's last mini-batches),
        claim the task finished on the status, and wait until every active device has
        finished it (the aggregator's retained config says so, `federation/task_gate.py`)
        and the global it had then has arrived; merge that global. Gives up after
        `task_gate` seconds and goes on."""
        held = self.client.held_update()
        if held is not None:
            self.pacer.pay()
            self._send(held)
        self.flush_sends()  # the task's updates go out before its claim
        self.finished_task = task
        self._status("online")
        self._waiting_global(True)
        start = time.monotonic()
        deadline = start + self.cfg.fed.task_gate

        def opened() -> bool | None:
            cfg = self.fleet_config or {}
            passed, version = cfg.get("tasks_passed", -1), cfg.get("gate_version", 0)
            held = self.latest.version if self.latest is not None else 0
            if gate_open(passed, task) and held >= version:
                return True
            return False if time.monotonic() >= deadline else None

        if self._wait(opened):
            with self.cond:
                g = self.latest
            if g is not None and merge_at_gate(self.client, g, self.cfg.fed) == MERGED:
                self.rounds += 1
                if self.cid in g.participants:  # else its last update waits for a round
                    self.unanswered = 0
        else:
            self.gate_timeouts += 1
            log.warning("%s: the task gate did not open within %.0f s after task %d; going on",
                        self.cid, self.cfg.fed.task_gate, task)
            self._merge_async()
        self.gate_waits += time.monotonic() - start
        self._waiting_global(False)

    def _sync_round(self, upd: Update | None) -> None:
        msg = upd if upd is not None else self.client.tick()
        tick = self.awaited_tick = msg.seq
        self.answers.clear()
        payload = self._send(msg)

        def resend() -> None:
            log.info("%s: no answer for tick %d, re-sending", self.cid, tick)
            self.link.publish(self.topics.update(self.cid), payload, qos=1)

        moved: list[float] = []  # when an answer to a later tick came: the fleet moved on

        def answered() -> dict | bool | None:
            if tick in self.answers:
                return self.answers.pop(tick)
            if self.fleet_tick > tick and not moved:
                moved.append(time.monotonic())
            return False if moved and time.monotonic() - moved[0] > 2 * self.answer_timeout \
                else None

        answer = self._wait(answered, self.answer_timeout, resend)
        if answer is False:
            raise UserError(f"{self.cid}: the lock-step fleet answers tick {self.fleet_tick}, "
                            f"past this device's tick {tick} (a device restarted from its "
                            "stream's start cannot rejoin a lock-step run; restart the fleet, "
                            "or run it async)")
        with self.cond:
            latest = self.latest
        if latest is not None:
            self._rejoin_if_ahead(latest)
        version = answer["version"]
        if self.cid in answer["participants"] and version > self.client.version:
            fetches = 0

            def fetch() -> None:
                nonlocal fetches
                fetches += 1
                self._fetch_whole()

            g = self._wait(lambda: self.latest if self.latest is not None and
                           self.latest.version >= version else (
                               False if fetches >= GLOBAL_FETCHES else None),
                           self.answer_timeout, fetch)
            if g is False:  # an answer naming a global that never came: go on without it
                self.rejections["answer_unmet"] += 1
                log.warning("%s: tick %d answered with version %d, which never came; going "
                            "on without it", self.cid, tick, version)
                return
            self.client.apply_global(g)
            self.rounds += 1

    def _rejoin_if_ahead(self, g: GlobalModel) -> None:
        """Take `g`, the newest global, whole when OLDER_GLOBALS globals in a row came older
        than the version this device holds: that version is not its aggregator's."""
        if self.older_globals >= OLDER_GLOBALS and g.version < self.client.version:
            log.warning("%s: the version held (%d) is not the aggregator's, whose globals are "
                        "at %d: taking its global", self.cid, self.client.version, g.version)
            rejoin(self.client, g)
            self.version_resets += 1
            self.older_globals = 0

    def _merge_async(self) -> None:
        with self.cond:
            self._refetch_if_due()
            g = self.latest
        if g is None:
            return
        self._rejoin_if_ahead(g)
        done = merge_global(self.client, g, self.cfg.fed)  # the simulator's decision too
        if done == MERGED:
            self.rounds += 1
            self.unanswered = 0
        elif done == CAUGHT_UP:
            self.catch_ups += 1
        self._listen()

    def _aggregator(self) -> str | None:
        """The incarnation of the aggregator process now serving (its retained config)."""
        return (self.fleet_config or {}).get("incarnation")

    def _resend_if_restarted(self) -> bool:
        """Async: when the last update is unanswered and another aggregator process has come
        up since it was sent, send it again (the same bytes: an aggregator that counted it
        after all drops the copy as a duplicate). True if it was sent."""
        now = self._aggregator()
        if not self.unanswered or self.last_update is None or now == self.last_update[3]:
            return False
        seq, base, payload, _ = self.last_update
        log.info("%s: the aggregator restarted; sending update %d again", self.cid, seq)
        self.link.publish(self.topics.update(self.cid), payload, qos=1)
        self.bytes_up += len(payload)
        self.last_update = (seq, base, payload, now)
        return True

    def _last_round(self) -> None:
        """Async, at the end of the stream: wait for a global that counts the unanswered
        updates, merged like any other (the device's last mini-batches reach its model, and a
        device whose stream ends before the first round closes does not end believing it
        trained alone). It waits `round_timeout` + 1 s, longer while the aggregator's status
        says it is not online (up to `join_timeout` s), and again after sending the last
        update to a restarted aggregator; it stops once the update is too stale to count."""
        if not self.unanswered:
            return
        seq = self.last_update[0] if self.last_update else self.client.seq
        log.info("%s: end of stream; waiting for a global that counts update %d", self.cid, seq)
        self.link.subscribe(self.topics.aggregator_status, self._on_message)
        self._waiting_global(True)
        patience = self.cfg.fed.round_timeout + 1.0
        deadline = time.monotonic() + patience
        give_up = deadline + self.join_timeout

        def settled() -> bool | None:
            nonlocal deadline
            self._merge_async()
            if self._resend_if_restarted():
                deadline = time.monotonic() + patience
            latest, now = self.latest, time.monotonic()
            base = self.last_update[1] if self.last_update else self.client.version
            stale = latest is not None and latest.version - base > self.cfg.fed.max_staleness
            online = (self.aggregator_state or {}).get("state", "online") == "online"
            if not self.unanswered or stale or (now >= deadline and (online or now >= give_up)):
                return True
            return None

        self._wait(settled)
        self._waiting_global(False)
        self.link.unsubscribe(self.topics.aggregator_status)
        if self.unanswered:
            log.warning("%s: no round counted update %d (see the aggregator's log)", self.cid,
                        seq)

    def results(self) -> dict:
        c = self.client
        out = {"client": self.cid, "accuracy_matrix": np.nan_to_num(self.acc).tolist(),
               "bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "rounds": self.rounds,
               "batches": c.batches, "scored_samples": c.scored, "version": c.version,
               "seq": c.seq,
               "timings": dict(c.timings), "link": self.link.counters() if self.link else {},
               "rejected": self.rejected, "rejections": dict(self.rejections),
               "duplicate_batches": self.duplicates,
               "catch_ups": self.catch_ups, "version_resets": self.version_resets,
               "gate_wait_s": round(self.gate_waits, 3),
               "gate_timeouts": self.gate_timeouts, "held_backpressure": self.pacer.held,
               "stream_s": round(self.stream_s, 3), "first_batch_at": self.first_batch_at,
               "batch_s_std": float(np.std(self.batch_s)) if self.batch_s else 0.0,
               "global_arrivals": {str(v): t for v, t in self.arrivals.items()}}
        if len(self.acc):
            acc = np.nan_to_num(self.acc)
            out["accuracy"] = float(100 * acc[-1].mean())
            out["forgetting"] = float(100 * forgetting(acc[None]))
            if c.protos is not None:
                out["known_labels"] = self.coverage[0].tolist()
                out["unknown_label_test_samples"] = self.coverage[1].tolist()
        return out | stream_report([c]) | self.result_fields()

    # -- hooks (no-ops here; see the class docstring) -------------------------------------
    def admit_stream(self, payload: bytes) -> bool:
        """A payload on this device's stream topic arrived; False drops it unhandled."""
        return True

    def check_alive(self) -> None:
        """Called while the device waits (every 50 ms at most); may raise to end the run."""

    def on_idle(self) -> None:
        """Called whenever the device polls for its next mini-batch."""

    def before_stream(self) -> bool:
        """Called before the stream is consumed; False: consume nothing."""
        return True

    def before_batch(self, batch: Batch) -> None:
        """Called before a mini-batch is trained."""

    def after_batch(self, batch: Batch) -> None:
        """Called after a mini-batch was trained and its update sent or held."""

    def after_stream(self) -> None:
        """Called once the whole stream was consumed (not when stopped)."""

    def send_update(self, seq: int, payload: bytes) -> None:
        """Publish an encoded update (QoS 1); in async mode after the pacer's send delay, on
        a timer (the device trains on meanwhile)."""
        self.bytes_up += len(payload)
        delay = self.pacer.delay() if self.cfg.fed.mode == "async" else 0.0
        later = _Later(lambda: self.link.publish(self.topics.update(self.cid), payload, qos=1))
        if delay <= 0:
            later.fire()
            return
        self._sends = [s for s in self._sends if not s.done] + [later]
        timer = threading.Timer(delay, later.fire)
        timer.daemon = True
        timer.start()

    def _pace(self) -> bool:
        """The pacer's decision on a due update; before it has measured the time between due
        updates, it starts from `jump` mini-batches (a fleet's first updates are spread too)."""
        if not self.pacer.period and self.batch_s:
            self.pacer.period = self.cfg.fed.jump * float(np.median(self.batch_s[-20:]))
        return self.pacer.take(time.monotonic())

    def flush_sends(self) -> None:
        """Publish now every update still waiting for its send delay."""
        for later in self._sends:
            later.fire()
        self._sends = []

    def send_last(self, seq: int, payload: bytes) -> None:
        """Publish the update held back to the end of the stream (after the last mini-batch),
        at once, after any still waiting."""
        self.flush_sends()
        self.link.publish(self.topics.update(self.cid), payload, qos=1)
        self.bytes_up += len(payload)

    def status_fields(self) -> dict:
        """Extra fields of every status message."""
        return {}

    def final_status(self, state: str, **extra) -> None:
        """The last status before the link closes (acknowledged)."""
        self._status(state, wait=True, **extra)

    def result_fields(self) -> dict:
        """Extra fields of the results."""
        return {}

    def after_run(self, state: str) -> None:
        """Called at the end of `run` ('done' or 'stopped'), after the results were written."""
