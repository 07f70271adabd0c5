"""The aggregator daemon: the Aggregator core behind an MQTT link, with a state directory it
resumes from after a restart or crash."""

from __future__ import annotations

import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from edgefcl.config import RunConfig
from edgefcl.federation.aggregator import Aggregator, RoundClosed
from edgefcl.federation.heads import initial_library
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.federation.registry import get_encoding
from edgefcl.federation.task_gate import GatePace
from edgefcl.federation.versions import delta_downlink, downlink_message, pull_downlink
from edgefcl.runtime.backpressure import Backpressure
from edgefcl.runtime.bodies import is_int
from edgefcl.runtime.fleet_results import FleetResults
from edgefcl.runtime.handling import handle_safely
from edgefcl.runtime.heap import freeze_startup_heap
from edgefcl.runtime.inbox import Inbox, sender_of, shed_counters
from edgefcl.runtime.links import (
    inbox_budget,
    message_limits,
    open_link,
    size_payload_limit,
    topics,
    update_limits,
    wire_dtype,
)
from edgefcl.runtime.store import StateStore, StateWriteError
from edgefcl.runtime.threads import stop_on_signals
from edgefcl.runtime.update_quota import RELEASE_EVERY, UpdateQuota
from edgefcl.transport.codec import (
    DEFAULT_MAX_BYTES,
    CodecError,
    Message,
    decode,
    encode,
    peek_seq,
    spec_hash,
    tensor_spec,
)
from edgefcl.transport.topics import UPDATE_KINDS

log = logging.getLogger("edgefcl.aggregator")
FORMING_S = 120.0
"""How long an --exit-when-done aggregator waits for a fleet to form (a device that loads its
data and model, or waits for the broker, is not heard from at once)."""

SENDER = "aggregator"
EXPIRE_EVERY = 0.1
"""Seconds between the main loop's checks for silent devices (`client_timeout` is seconds)."""


class AggregatorDaemon:
    """Runs an Aggregator over MQTT until stopped (SIGTERM/SIGINT, `control` stop, or with
    `exit_when_done` when the run is over: `_run_over`).

    State directory: `state.db`, one transaction per round (`runtime.store`; the global's
    prototype library, head `prototypes`, is saved with its tensors), validated on
    start; a foreign or finished state is refused unless `fresh` (start over) or `resume`
    (continue a finished run). `state.json`, `global.npz` and `rounds.jsonl` are views of it.
    """

    aggregator_class = Aggregator
    """The core it runs (the sharded root runs a subclass: runtime/shard_root.py)."""
    payload_from_model = True
    """Size `max_payload` from the model when it is 0 (a root takes workers' partials, which
    can be larger than any device's update, so it keeps the 64 MiB default)."""

    def __init__(self, cfg: RunConfig, initial: Tensors, state_dir: Path,
                 exit_when_done: bool = False, status_every: float = 2.0,
                 inbox_bytes: int = 0, fresh: bool = False, resume: bool = False) -> None:
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.topics = topics(cfg.mqtt)
        library = initial_library(cfg, initial, get_encoding(cfg.fed.encoding).bayesian)
        self.agg = self.aggregator_class(initial, cfg.fed, batch_size=cfg.data.batch_size,
                                         prototypes=library,
                                         row_prior_sigma=cfg.learn.bayes_sigma,
                                         wire_dtype=wire_dtype(cfg.mqtt))
        self.spec_hash = spec_hash(tensor_spec(initial))
        self.exit_when_done = exit_when_done
        self.status_every = status_every
        if self.payload_from_model:
            size_payload_limit(cfg, initial)
        self.max_payload = cfg.mqtt.max_payload or DEFAULT_MAX_BYTES
        self.update_limits = update_limits(initial)
        budget = inbox_bytes or inbox_budget(cfg.mqtt)
        self.quota = UpdateQuota(max_bytes=budget)  # fair service while backpressure is on
        self.inbox = Inbox(max_bytes=budget,
                           sender_of=sender_of(self.topics), rate=cfg.fed.sender_rate,
                           cpu_share=cfg.fed.sender_cpu,
                           over_limit=self.quota.over,
                           is_report=lambda topic: self.topics.kinds_on(topic) == UPDATE_KINDS,
                           supersede=cfg.fed.mode == "async")
        self.backpressure = Backpressure.for_fed(cfg.fed)
        self.stop_event = threading.Event()
        # before the first state is saved: a SIGTERM from then on (while the CLI still loads
        # evaluation data, say) is a graceful stop, never a kill by the default handler
        stop_on_signals(self.stop_event)
        self.incarnation = secrets.token_hex(8)
        """This process, in its config and status: a device whose updates it has not counted
        sends the last one again when it sees another (the updates it held died with it)."""
        self.done: set[str] = set()
        self.bytes_in: dict[str, int] = {}
        self.bytes_out = 0
        self.round_bytes_in = 0
        self.rounds_log: list[dict] = []  # the last rounds, for the status
        self.last_answer: bytes | None = None
        self.reanswered: dict[str, int] = {}  # client -> tick it was last answered again
        self.gate = (-1, 0)
        """The task gate last announced: (tasks passed, the global version then)."""
        self._gate_pace = GatePace()
        self._next_release = 0.0
        self.ever_done: set[str] = set()  # roster clients that said done in this run
        self.heard = time.monotonic()
        """When the daemon last took input that keeps an ending run open (`_heard`)."""
        self._next_expiry = 0.0
        self.spec = tensor_spec(self.agg.global_.tensors)
        self.store = StateStore.open(self.state_dir, fleet=cfg.mqtt.fleet, spec=self.spec,
                                     fresh=fresh, resume=resume)
        if not self._load_state():
            self._save_state(None, initial=True)
        self.run_id = self.store.meta()["run_id"]
        """This run's id (kept across restarts): in the config, and in the statuses of the
        devices that report to it."""
        self.link = None
        # what devices check before they train (runtime/join.py), held-out evaluation and the
        # fleet's results (runtime/fleet_results.py); the CLI may set them before run()
        self.profile: dict = {"spec_hash": self.spec_hash}
        self.evaluator = None
        self.labels: list[str] | None = None
        self.results: FleetResults | None = None

    # -- persistence ----------------------------------------------------------------------
    def _load_state(self) -> bool:
        library = self.agg.global_.prototypes  # the initial (empty) library sets the width
        loaded = self.store.load(self.spec, None if library is None else library.width,
                                 library is not None and library.gaussian)
        if loaded is None:
            return False
        state, tensors, library = loaded
        self.store.write_views(state, tensors, rewrite=True, prototypes=library)
        self.agg.load_state(state | {"tensors": tensors, "prototypes": library})
        self.done = set(state.get("done", []))
        self.ever_done = set(self.done)
        self.bytes_in = {str(c): int(n) for c, n in state.get("bytes_in", {}).items()}
        self.bytes_out = int(state.get("bytes_out", 0))
        self.rounds_log = self.store.round_lines()[-20:]
        log.info("resumed run %s from %s at version %d (round %d)", self.store.meta()["run_id"],
                 self.state_dir, self.agg.global_.version, self.agg.rounds)
        return True

    def _save_state(self, closed: RoundClosed | None, global_bytes: int = 0,
                    initial: bool = False) -> None:
        """One transaction: the new global (if a round closed), its round line and the state
        that counted its updates."""
        state = self.agg.state()
        tensors = state.pop("tensors")
        state["done"] = sorted(self.done)
        state["spec_hash"] = self.spec_hash
        state["bytes_in"], state["bytes_out"] = dict(self.bytes_in), self.bytes_out
        line = None
        if closed is not None and closed.global_ is not None:
            line = {"round": self.agg.rounds, "version": closed.global_.version,
                    "tick": closed.tick, "participants": list(closed.participants),
                    "seqs": closed.seqs, "carried": closed.carried,
                    "bytes_in": self.round_bytes_in, "global_bytes": global_bytes,
                    "time": round(time.time(), 3)}
            if self.results is not None:
                line.update(self.results.on_round(closed.global_))
        with_global = line is not None or initial
        library = self.agg.global_.prototypes  # saved with the tensors, under one sha256
        self.store.commit(state, tensors if with_global else None, line, library)
        if line is not None:
            self.rounds_log.append(line)
            del self.rounds_log[:-20]
        self.store.write_views(state, tensors if with_global else None, line,
                               prototypes=library)

    # -- MQTT -----------------------------------------------------------------------------
    def _publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.bytes_out += self.link.publish(topic, payload, qos=1, retain=retain)

    def _publish_config(self) -> None:
        self._publish(self.topics.config, self._config_payload(), retain=True)

    def _config_payload(self) -> bytes:
        """The retained config: the fleet's settings, this run, the gate and the pacing."""
        f = self.cfg.fed
        body = {"burn_in": f.burn_in, "jump": f.jump, "mode": f.mode, "encoding": f.encoding,
                "aggregation": f.aggregation, "min_clients": f.min_clients,
                "spec_hash": self.spec_hash, "clients": f.clients, "run": self.run_id,
                "incarnation": self.incarnation, "pull_globals": pull_downlink(f)
                } | self.profile | (
                    self.backpressure.fields()) | self._gate_fields()
        return encode(Message("config", body), fleet=self.cfg.mqtt.fleet, sender=SENDER)

    def _encode_global(self, g: GlobalModel) -> bytes:
        return encode(replace(g, run=self.run_id), fleet=self.cfg.mqtt.fleet, sender=SENDER,
                      wire_dtype=wire_dtype(self.cfg.mqtt))

    def _publish_global(self, g: GlobalModel, payload: bytes | None = None) -> None:
        self._publish(self.topics.global_, payload or self._encode_global(g), retain=True)

    def _answer(self, closed: RoundClosed) -> None:
        body = {"tick": closed.tick or 0, "version": self.agg.global_.version,
                "participants": list(closed.participants)}
        self.last_answer = encode(Message("answer", body), fleet=self.cfg.mqtt.fleet,
                                  sender=SENDER)
        self._publish(self.topics.tick, self.last_answer)

    def status(self) -> dict:
        """Counters and round state, as published on the aggregator status topic."""
        return {"state": "online", "incarnation": self.incarnation,
                "version": self.agg.global_.version,
                "rounds": self.agg.rounds, "tick": self.agg.tick,
                "active": sorted(self.agg.active), "done": sorted(self.done),
                "counters": dict(self.agg.counters) | shed_counters(self.inbox),
                "flooding": dict((self.inbox.offenders + self.quota.shed).most_common(5)),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "last_rounds": self.rounds_log[-5:],
                "busy": self.backpressure.busy} | (
                    self.results.status() if self.results is not None else {}) | (
                    self.backpressure.fields() | self.quota.fields())

    def _publish_status(self, state: str = "online", finished: bool = False) -> None:
        """The retained status; `finished`: the run ended (its workers may exit)."""
        body = self.status() | {"state": state} | ({"finished": True} if finished else {})
        self._publish(self.topics.aggregator_status,
                      encode(Message("status", body), fleet=self.cfg.mqtt.fleet, sender=SENDER),
                      retain=True)

    # -- message handling -----------------------------------------------------------------
    def handle(self, topic: str, payload: bytes | CodecError, admitted: bool = False) -> None:
        """Validate and apply one incoming message (or a transfer the link already rejected);
        never raises: every failure is logged and counted as `rejected_<reason>`. Its time,
        but for taking an update that passed its checks and the rounds that closes, counts
        against the sender's CPU share (`Inbox.charging`)."""
        handle_safely(lambda: self._handle(topic, payload, admitted), topic,
                      self._charged(topic), self.inbox, self.agg.counters, log)

    def _charged(self, topic: str) -> str | None:
        """Whose CPU share handling a message on `topic` counts against (None: no one's)."""
        return self.inbox.sender_of(topic)

    def _handle(self, topic: str, payload: bytes | CodecError, admitted: bool = False) -> None:
        if isinstance(payload, CodecError):
            raise payload
        allowed = self.topics.kinds_on(topic)
        if not allowed:
            raise CodecError("topic", f"no message is accepted on {topic}")
        sender = None if topic == self.topics.control else self.topics.client_from(topic)
        reports = allowed == UPDATE_KINDS and not admitted  # (a released one was judged)
        peeked = peek_seq(payload) if reports else None
        if reports and not self.quota.admit(sender, (topic, payload), len(payload), peeked):
            return  # over its pace or fair share under backpressure: refused, or waits
        msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.max_payload,
                     require_digest=True,  # a damaged update must never be aggregated
                     limits=message_limits(allowed, self.update_limits))
        kind = msg.kind if isinstance(msg, Message) else type(msg).__name__.lower()
        if kind not in allowed:
            raise CodecError("kind", f"a {kind} message on {topic}")
        if reports and isinstance(msg, (Update, Tick)) and not self.quota.paced_once_decoded(
                sender, msg.seq, peeked):
            return
        getattr(self, self._ON_MESSAGE.get(kind, "_on_other"))(msg, sender, len(payload),
                                                               time.monotonic())

    _ON_MESSAGE: ClassVar[dict[str, str]] = {
        "update": "_on_report", "tick": "_on_report", "status": "_on_device_status",
        "control": "_on_control"}
    """Kind -> the method that handles it (`transport/kinds.py` names the kinds and their
    topics; a kind a topic admits but the daemon does not handle is counted rejected_kind)."""

    def _on_report(self, msg: Update | Tick, sender: str | None, size: int, now: float) -> None:
        """A device's update or lock-step tick: submitted to the round (after its sender is
        checked against the topic), with the lock-step answer resent to a retransmission."""
        if sender is not None and msg.client != sender:
            self.agg.counters["rejected_sender"] += 1
            log.warning("rejected %s: claims client %s on the topic of %s",
                        type(msg).__name__, msg.client, sender, extra={"device": sender})
            return
        self.round_bytes_in += size
        if (self.cfg.fed.mode == "sync" and self.last_answer is not None
                and 1 <= msg.seq <= self.agg.last_seq.get(msg.client, 0)
                and self.reanswered.get(msg.client) != self.agg.tick):
            # an admitted client retransmitted a report it sent (its answer was lost):
            # answered again, once per client and tick, so a flood is not amplified
            self.reanswered[msg.client] = self.agg.tick
            self._publish(self.topics.tick, self.last_answer)
        accepted = not self.agg.rejects(msg)  # the checks: charged to the device
        # counted before `take`, so that a round this update closes is saved with it; bounded by
        # the roster (an accepted client is on it or learned by `take`): never a map of every id
        if accepted or msg.client in self.agg.admission.roster:
            self.bytes_in[msg.client] = self.bytes_in.get(msg.client, 0) + size
        if accepted:
            self._heard(now)
            self._close_safely(lambda: self.agg.take(msg, now))
        if msg.client in self.done and msg.client in self.agg.active:
            # a queued update that arrived after the client's retained "done": it reports
            # nothing more, so no round waits for it
            self._close_safely(lambda: self.agg.leave(msg.client, now))

    def _on_device_status(self, msg: Message, sender: str | None, size: int,
                          now: float) -> None:
        """A device's status, from its own topic."""
        if sender is None:
            self._on_other(msg, sender, size, now)
        else:
            self._on_status(sender, msg.body, now)

    def _on_control(self, msg: Message, sender: str | None, size: int, now: float) -> None:
        """The operator's command: stop ends the daemon (pause and resume are the devices')."""
        self._heard(now)
        if msg.body.get("command") == "stop":
            self.stop_event.set()

    def _on_other(self, msg: object, sender: str | None, size: int, now: float) -> None:
        """A kind this daemon does not handle: counted."""
        self.agg.counters["rejected_kind"] += 1

    def _on_status(self, client: str, body: dict, now: float) -> None:
        """A device's status. Only roster clients count: an id the roster does not admit
        neither joins nor finishes the run, and leaves no trace in the daemon's state; a
        `done` that names another run (a retained one of an earlier run) is not this run's."""
        state = body.get("state")
        if state == "done" and isinstance(body.get("run"), str) and body["run"] != self.run_id:
            self.agg.counters["done_of_another_run"] += 1
            if client in self.agg.active:  # it sends no more (it served an earlier run)
                self._close_safely(lambda: self.agg.leave(client, now))
            return
        if state == "online":
            if not self.agg.join(client, now):
                return  # counted as rejected_roster
            if not self.done:  # a fleet still forming: its devices may be loading
                self._heard(now)
            self.done.discard(client)
            task = body.get("finished_task")
            if is_int(task):
                self._close_safely(lambda: self.agg.finish_task(client, task, now))
            inc = body.get("incarnation")
            if isinstance(inc, str) and 0 < len(inc) <= 64 and inc.isprintable() and \
                    self.agg.admission.session(client, inc):
                self.agg.counters["new_sessions"] += 1
                log.info("%s: new device incarnation %s (sequence numbers start again)",
                         client, inc, extra={"device": client})
        elif state in ("offline", "done") and not self.agg.admission.admit(client):
            self.agg.counters["rejected_roster"] += 1  # (a learned roster with room learns it)
        elif state in ("offline", "done"):
            if state == "done":
                if client not in self.ever_done:  # (a device flapping online / done: once)
                    self.ever_done.add(client)
                    self._heard(now)
                self.done.add(client)
                if self.results is not None:
                    self.results.on_device_done(client, body)
            if client in self.agg.active:
                self._close_safely(lambda: self.agg.leave(client, now))
        self._announce_gate(now)

    @property
    def _gated(self) -> bool:
        """Async with `task_gate`: the daemon runs the task gate (`federation/task_gate.py`)."""
        return self.cfg.fed.mode == "async" and self.cfg.fed.task_gate > 0

    def _gate_fields(self) -> dict:
        """The task gate on the retained config (devices wait at a task's end only for an
        aggregator that advertises it)."""
        return {"tasks_passed": self.gate[0], "gate_version": self.gate[1]} if self._gated else {}

    def _announce_gate(self, now: float) -> None:
        """When the task gate moved, re-publish the retained config with it and the global
        version it opened at (after that global), as `GatePace` allows."""
        passed = self.agg.tasks_passed
        if self._gated and passed != self.gate[0] and self._gate_pace.allow(now):
            self.gate = (passed, self.agg.global_.version)
            self._publish_config()

    def _closed(self, closed: RoundClosed | None, before: tuple) -> None:
        """Save and announce what closed; a new global that cannot be written or saved is
        undone (the aggregator goes back to `before`, its `mark()`) and the error raised: no
        version exists that was not saved first."""
        if closed is None:
            return
        if closed.global_ is not None:
            try:
                payload = self._encode_global(closed.global_)
                self._save_state(closed, len(payload))  # saved before it is announced
            except Exception as e:
                if self.store.published(closed.global_.version) is None:
                    self.agg.restore(before)
                if isinstance(e, (OSError, sqlite3.Error)):  # a full disk: no bug to trace
                    raise StateWriteError(f"cannot save version {closed.global_.version} in "
                                          f"{self.state_dir} ({e})") from e
                raise
            self.round_bytes_in = 0
            self._publish_global(closed.global_, payload)
            if delta_downlink(self.cfg.fed):  # devices at the previous version take the change
                delta = downlink_message(closed.global_, self.agg.history,
                                         closed.global_.version - 1)
                if delta is not closed.global_:
                    self._publish(self.topics.global_delta, self._encode_global(delta))
        # A lock-step tick without a new global is not saved: after a crash the clients
        # re-send their unanswered reports and the tick is collected again.
        if self.cfg.fed.mode == "sync":
            self._answer(closed)

    def _serve_rounds(self, now: float) -> None:
        """Close what is due (async timeouts, silent clients)."""
        if self.cfg.fed.mode == "async":
            superseded = self.inbox.take_superseded()
            if superseded:  # dropped unread: counted where state.json keeps them
                self.agg.counters["superseded_in_inbox"] += superseded
            lost = self.inbox.take_lost()
            if lost:
                self._close_safely(lambda: self.agg.lost(lost, now))
            self._close_safely(lambda: self.agg.poll(now))
        if now >= self._next_expiry:  # a scan of every active device: not once per message
            self._next_expiry = now + EXPIRE_EVERY  # (4 % of the main loop at 1,000 devices)
            self._close_safely(lambda: self.agg.expire(now))
        self._announce_gate(now)

    def _save_final(self, finished: bool) -> None:
        """Save the state (and, when `finished`, mark the run ended); a state it cannot write
        (a full disk) is one line, and the daemon still says it stopped."""
        try:
            self._save_state(None)
            if finished:
                self.store.mark_finished()
        except (OSError, sqlite3.Error) as e:
            log.error("cannot save the state in %s (%s); free space in --state-dir",
                      self.state_dir, e)

    def _close_safely(self, step: Callable[[], RoundClosed | None]) -> None:
        """Run one aggregator step that may close a round, then save and announce what
        closed. A step or an announcement that fails (a bug reached by input) drops the open
        round, counted and logged, so that it cannot fail every later step; a lock-step tick is
        then answered without a global, so that devices go on."""
        before = self.agg.mark()
        with self.inbox.uncharged():  # the fleet's work, not the device's that set it off
            try:
                self._closed(step(), before)
            except Exception as e:
                if isinstance(e, StateWriteError):
                    self.agg.counters["state_write_failed"] += 1
                    log.error("%s: the open round is dropped; free space in --state-dir", e)
                else:
                    self.agg.counters["rejected_internal"] += 1
                    log.exception("internal error in the aggregator: the open round is dropped")
                self.agg.drop_round()
                if self.cfg.fed.mode == "sync":
                    self._answer(RoundClosed(self.agg.tick, None))

    def _pressure(self) -> None:
        """Update the backpressure factor from the inbox's last interval; a changed factor is
        re-published on the retained config (devices follow it there)."""
        spread = self.backpressure.spread
        line = self.backpressure.observe(self.inbox.load().less(self.quota.refused),
                                         self.status_every, self.quota.rise)
        self.backpressure.spread_for(len(self.agg.active))
        limit = self.quota.end_interval(self.status_every, set(self.agg.active),
                                        self.backpressure.factor, self.inbox.take_refused())
        for said in (line, limit):
            if said:
                log.info(said)
        if line or self.backpressure.spread != spread:
            self._publish_config()

    def _release_due(self, now: float) -> None:
        """Handle the updates whose device has a token again (every RELEASE_EVERY s: the
        buckets refill continuously, so the waiting updates come back spread out)."""
        if now < self._next_release:
            return
        self._next_release = now + RELEASE_EVERY
        for topic, payload in self.quota.release():
            self.handle(topic, payload, admitted=True)

    def _release_waiting(self) -> bool:
        """Handle every update still waiting for its device's token (the run is ending: none
        is left behind); True when there were some."""
        held = self.quota.release(everything=True)
        for topic, payload in held:
            self.handle(topic, payload, admitted=True)
        return bool(held)

    def subscriptions(self) -> list[str]:
        """What the daemon listens to: device updates and statuses, operator control."""
        return [self.topics.updates, self.topics.statuses, self.topics.control]

    def _heard(self, now: float) -> None:
        """Note input that keeps an ending run open: an accepted report, a device's first
        `done`, the operator's command, or, while no device is done, a roster device's
        `online`. Nothing a device sends that is rejected counts (a done device that sent junk
        on its update topic, or a roster device that never reported, kept the run open for
        ever), and neither do the statuses of a formed fleet's devices: only reports prove a
        device alive."""
        self.heard = max(self.heard, now)

    def _run_over(self, now: float, last_input: float) -> bool:
        """With `exit_when_done`: every roster client reported its stream done (the whole
        roster, or as many as a learned one admits), then a quiet second; or, once one did,
        none is active and nothing came for `client_timeout` seconds (the others were killed
        or never came). One device's `done` while the others have not joined yet, or are
        reconnecting, does not end the run. A fleet that never forms (no roster client heard
        for `client_timeout` seconds, at least FORMING_S, none done) ends it too: `run` then
        exits with 1."""
        if not self.exit_when_done or self.agg.active:
            return False
        quiet = now - last_input
        if self.done and len(self.done) >= self.agg.admission.cap:
            return quiet >= 1.0
        timeout = self.cfg.fed.client_timeout
        if not self.done:  # not formed yet: devices may still be loading or reconnecting
            timeout = max(timeout, FORMING_S)
        return timeout > 0 and quiet >= timeout

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped; returns an exit code."""
        will = (self.topics.aggregator_status,
                encode(Message("status", {"state": "offline"}), fleet=self.cfg.mqtt.fleet,
                       sender=SENDER), 1, True)
        self.link = open_link(self.cfg.mqtt, f"{self.cfg.mqtt.fleet}-aggregator", will=will,
                              on_reject=self.inbox.put)
        created = self.store.meta().get("created")
        self.results = FleetResults(self.cfg, self.state_dir, self.profile, self.evaluator,
                                    self.labels, float(created) if created else None)
        for pattern in self.subscriptions():
            self.link.subscribe(pattern, self.inbox.put)
        self._publish_config()
        self._publish_global(self.agg.global_)
        log.info("aggregator for fleet %s serving on %s (mode %s, version %d)",
                 self.cfg.mqtt.fleet, self.cfg.mqtt.broker, self.cfg.fed.mode,
                 self.agg.global_.version)
        freeze_startup_heap()
        next_status = 0.0
        finished = False
        self.heard = time.monotonic()  # exit only after a quiet second: after a restart the
        # messages queued for this session and the retained statuses arrive in any order
        reconnects = self.link.reconnects
        while not self.stop_event.is_set():
            item = self.inbox.get(timeout=0.1)
            if item is not None:
                self.handle(*item)
            now = time.monotonic()
            self.link.expire_pending()
            if self.link.reconnects != reconnects and self.link.is_connected:
                reconnects = self.link.reconnects  # the broker may have lost retained messages
                self._publish_config()
                self._publish_global(self.agg.global_)
            self._serve_rounds(now)
            self._release_due(now)
            if now >= next_status:
                self._pressure()
                self._publish_status()
                next_status = now + self.status_every
            if self.results.check_done(self.done, self.agg.active, self):
                self._save_final(finished=True)  # every expected client is done: it ended
                self._publish_status()  # operators see the final rounds at once
            if self._run_over(now, self.heard) and not self._release_waiting():
                finished = True
                break
        self.results.check_done(self.done, self.agg.active, self, force=True)  # one that waited
        formed = bool(self.done)
        self._save_final(finished=finished and formed)
        self.store.close()
        self._publish_status("stopped", finished=finished and formed)
        self.link.close()
        log.info("aggregator stopped at version %d after %d rounds", self.agg.global_.version,
                 self.agg.rounds)
        if finished and not formed:
            log.error("no client finished its stream, and no roster client was heard for %g s: "
                      "the fleet never formed; check that the clients run with this --fleet "
                      "and --broker (their logs say why they stopped)",
                      max(self.cfg.fed.client_timeout, FORMING_S))
            return 1
        return 0
