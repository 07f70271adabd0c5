"""Simulated device firmware: the real DeviceRunner and Client inside device-like limits, with
state kept in flash so that a reboot or `kill -9` resumes where the device stopped.

Exactly-once consumption of the stream across crashes (write-ahead inbox):
1. A stream message is written to the flash inbox inside the MQTT message callback, before it
   returns. paho acknowledges a QoS 1 message (PUBACK) only after the callback returned, so
   every batch the broker considers delivered is in flash; every batch not in flash is still
   unacknowledged and the broker redelivers it to the persistent session after a reconnect.
2. The device trains on one batch, then reaches its safe point: the state file (client
   checkpoint, stream position, counters, the update produced by this batch) is replaced
   atomically, and only then is the batch's inbox entry deleted and its update published.
3. On boot the device restores the state file and queues the inbox entries after the saved
   position, in arrival order. A batch is dropped on arrival if it is at or before the newest
   position held in flash (QoS 1 redeliveries). A crash before a safe point loses that batch's
   training and nothing else: it left no trace outside the process, and it is still in the
   inbox, so it is trained on once after the reboot. Hence every batch is trained on exactly
   once in the lineage that survives, in stream order.

Updates: the last update is kept in the state file with its sequence number until a newer
one replaces it and is published again (same seq) after every boot; the aggregator drops the
copy if it already had it (duplicate counter), so no update is aggregated twice. An update is
handed to the MQTT client only while the link is up and the radio has finished sending the
previous one (`tx_ready`); a newer update replaces one still waiting (counted as superseded),
so a slow or intermittent link carries the freshest update instead of a growing queue.

Compute: after every mini-batch the device sleeps (slowdown - 1) x its measured compute time;
when the predicted device time of the next batch exceeds the budget, it skips TTA scoring for
that batch (class-balanced random selection instead). Clock skew shifts the device's
timestamps (status `clock`, log records) only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import ConfigError, RunConfig
from edgefcl.data.types import Batch, TaskData
from edgefcl.learn.client import Client
from edgefcl.runtime.device_runner import END, DeviceRunner
from edgefcl.transport.codec import CodecError, Message, as_batch, decode
from edgefcl.transport.mqtt import TransportError
from firmware_sim.flash import Flash
from firmware_sim.profile import DeviceProfile

log = logging.getLogger("firmware_sim.device")

STATE_FORMAT = 1
EMA = 0.3
"""Weight of the newest mini-batch in the compute-time estimates."""
FINAL_WAIT_S = 120.0
"""How long a device that finished its stream waits for its link to flush the last messages."""


class Crash(Exception):
    """The device lost power or its watchdog fired: everything not in flash is gone."""


@dataclass
class TrainedLog:
    """Constant-size record of the batches trained on, in the lineage kept in flash: their
    number, a hash chain over their (task, index) positions, and how many came out of stream
    order. `expected_digest` computes the chain of a whole stream for comparison."""

    count: int = 0
    digest: str = ""
    out_of_order: int = 0
    last: tuple[int, int] = (-1, -1)

    def add(self, key: tuple[int, int]) -> None:
        if tuple(key) <= tuple(self.last):
            self.out_of_order += 1
        self.digest = chain(self.digest, key)
        self.count += 1
        self.last = (int(key[0]), int(key[1]))


def chain(digest: str, key: tuple[int, int]) -> str:
    """The next link of a TrainedLog hash chain."""
    return hashlib.sha256(f"{digest}|{int(key[0])}:{int(key[1])}".encode()).hexdigest()[:32]


def expected_digest(keys: list[tuple[int, int]]) -> str:
    """The TrainedLog digest of a stream trained on exactly once, in order."""
    d = ""
    for k in keys:
        d = chain(d, k)
    return d


class Firmware(DeviceRunner):
    """One boot of a device: a DeviceRunner whose state lives in `flash` (see module doc).

    `crash` (set by a reboot timer or an operator) makes the device stop abruptly at its next
    step, without a safe point. The link is whatever `cfg.mqtt.broker` points at (the radio).
    """

    def __init__(self, cfg: RunConfig, client: Client, profile: DeviceProfile, flash: Flash,
                 eval_tasks: list[TaskData] | None, out: Path | None,
                 skew_s: float = 0.0, crash: threading.Event | None = None,
                 tx_ready: Callable[[], bool] | None = None) -> None:
        if cfg.fed.mode != "async":
            raise ConfigError("firmware_sim devices run the deployment mode: set [fed] mode = "
                              "\"async\" (lock-step rounds would wait for crashed devices)")
        super().__init__(cfg, client, None, eval_tasks, out)
        self.profile = profile
        self.flash = flash
        self.skew_s = skew_s
        self.crash = crash or threading.Event()
        self.tx_ready = tx_ready or (lambda: True)
        self._held: tuple[int, bytes] | None = None  # waiting for the radio
        self.position: tuple[int, int] = (-1, -1)  # last batch whose effects are in flash
        self.trained = TrainedLog()
        self.pending: tuple[int, bytes] | None = None  # the last update: (seq, payload)
        self._unsaved: tuple[int, bytes] | None = None  # produced by the batch in progress
        self.fw: Counter[str] = Counter()
        self.link_totals: Counter[str] = Counter()  # link counters of earlier boots
        self.done = False
        self._recv_lock = threading.Lock()
        self._received: tuple[int, int] = (-1, -1)  # newest batch position held in flash
        self._got_end = False
        self._inbox_ids: dict[tuple[int, int] | None, int] = {}  # None: the end-of-stream
        self._ema_train = 0.0
        self._ema_score = 0.0
        self._timing0: dict[str, float] = {}
        self._restore()

    # -- flash ----------------------------------------------------------------------------
    def _restore(self) -> None:
        state = self.flash.load()
        if state is not None:
            if state.get("format") != STATE_FORMAT:
                raise ConfigError(f"{self.flash.state_path}: unknown state format; delete it")
            self.client.load_state_dict(state["client"])
            d = state["device"]
            self.consumed, self.rounds, self.catch_ups = d["consumed"], d["rounds"], d["catch_ups"]
            self.bytes_up, self.bytes_down = d["bytes_up"], d["bytes_down"]
            self.rejected, self.duplicates = d["rejected"], d["duplicates"]
            self.acc = np.array(d["acc"], dtype=np.float64)
            self.position = tuple(d["position"])
            self.trained = TrainedLog(**d["trained"])
            self.pending = d["pending"]
            self.fw = Counter(d["fw"])
            self.link_totals = Counter(d["link"])
            self.done = d["done"]
            self._ema_train, self._ema_score = d["ema"]
            self.incarnation = d.get("incarnation", self.incarnation)  # kept on flash
        self.fw["boots"] += 1
        self._received = self.position
        self._got_end = self.done
        for n, payload in self.flash.inbox():
            self._replay_inbox(n, payload)

    def _replay_inbox(self, n: int, payload: bytes) -> None:
        try:
            msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.cfg.mqtt.max_payload)
        except CodecError as e:  # cannot happen with atomic writes; never trust flash blindly
            log.warning("%s: dropping unreadable inbox entry %d: %s", self.cid, n, e)
            self.flash.inbox_drop(n)
            return
        if not isinstance(msg, Message) or msg.kind != "stream":
            self.flash.inbox_drop(n)
            return
        if msg.body.get("end_of_stream"):
            self._got_end = True
            self._inbox_ids[None] = n
            self.batches.put(END)
            return
        key = (msg.body["task"], msg.body["index"])
        if key <= self.position:  # trained and saved; the crash came before the delete
            self.flash.inbox_drop(n)
            return
        self._received = max(self._received, key)
        self._inbox_ids[key] = n
        self.batches.put(as_batch(msg))
        self.fw["inbox_replayed"] += 1

    def device_state(self) -> dict[str, Any]:
        """The device-level part of the state file."""
        link = self.link_totals + Counter(self.link.counters() if self.link else {})
        return {"consumed": self.consumed, "rounds": self.rounds, "catch_ups": self.catch_ups,
                "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down, "rejected": self.rejected,
                "duplicates": self.duplicates, "acc": self.acc.tolist(),
                "position": list(self.position), "trained": dataclasses.asdict(self.trained),
                "pending": self.pending, "fw": dict(self.fw), "link": dict(link),
                "done": self.done, "ema": (self._ema_train, self._ema_score),
                "incarnation": self.incarnation}

    def save(self) -> None:
        """Write the state file (a safe point)."""
        t0 = time.perf_counter()
        self.fw["saves"] += 1
        self.flash.save({"format": STATE_FORMAT, "device": self.device_state(),
                         "client": self.client.state_dict()})
        self.fw["save_s"] += time.perf_counter() - t0

    # -- inbound: the write-ahead inbox ---------------------------------------------------
    def admit_stream(self, payload: bytes) -> bool:
        """Store a new stream message in flash; False for a redelivery already held."""
        try:
            msg = decode(payload, self.cfg.mqtt.fleet, max_bytes=self.cfg.mqtt.max_payload)
        except CodecError:
            return True  # the runner counts and logs the rejection
        if not isinstance(msg, Message) or msg.kind != "stream":
            return True
        with self._recv_lock:
            if msg.body.get("end_of_stream"):
                if self._got_end:
                    return False
                self._got_end = True
                self._inbox_ids[None] = self.flash.inbox_put(payload)
                return True
            key = (msg.body["task"], msg.body["index"])
            if key <= self._received:
                self.duplicates += 1
                self.fw["redelivered_dropped"] += 1
                return False
            self._inbox_ids[key] = self.flash.inbox_put(payload)
            self._received = key
        return True

    def check_alive(self) -> None:
        if self.crash.is_set():
            raise Crash

    # -- the mini-batch loop --------------------------------------------------------------
    def before_stream(self) -> bool:
        if self.done:
            return False
        if self.pending is not None:  # restored from flash: it may never have left
            self.fw["resent_updates"] += 1
            log.info("%s: re-sending update seq %d after boot", self.cid, self.pending[0])
            self._offer(self.pending)
        return True

    def before_batch(self, batch: Batch) -> None:
        self._check_budget()

    def after_batch(self, batch: Batch) -> None:
        if self.crash.is_set():  # trained, but the safe point never came
            raise Crash
        self._safe_point(batch)
        self._throttle()

    def _offer(self, update: tuple[int, bytes]) -> None:
        """Queue an update for the radio; it replaces one that is still waiting."""
        if self._held is not None:
            self.fw["superseded"] += 1
        self._held = update
        self._flush()

    def _flush(self) -> None:
        """Publish the waiting update if the link is up and the radio is free."""
        held = self._held
        if held is None or not self.link.is_connected or not self.tx_ready():
            return
        self._held = None
        self.link.publish(self.topics.update(self.cid), held[1], qos=1)
        self.bytes_up += len(held[1])
        self.fw["updates_sent"] += 1

    def on_idle(self) -> None:
        self._flush()  # polled every 50 ms while the device waits for data

    def after_stream(self) -> None:
        """End of stream: wait (bounded) until the last update went out."""
        deadline = time.monotonic() + FINAL_WAIT_S
        while self._held is not None and time.monotonic() < deadline:
            self._flush()
            if self.crash.wait(0.05):
                raise Crash

    def send_update(self, seq: int, payload: bytes) -> None:
        self._unsaved = (seq, payload)  # published after the safe point

    def send_last(self, seq: int, payload: bytes) -> None:
        """No safe point follows the stream's last update: it is saved and offered now."""
        self.pending = (seq, payload)
        self.save()
        self._offer(self.pending)

    def _safe_point(self, batch: Batch) -> None:
        key = (batch.task, batch.index)
        self.position = key
        self.trained.add(key)
        update, self._unsaved = self._unsaved, None
        if update is not None:
            self.pending = update
        self.save()
        n = self._inbox_ids.pop(key, None)
        if n is not None:
            self.flash.inbox_drop(n)
        if update is not None:
            self._offer(update)
        else:
            self._flush()

    # -- compute budget -------------------------------------------------------------------
    def _check_budget(self) -> None:
        c = self.profile.compute
        self._timing0 = dict(self.client.timings)
        predicted_ms = (self._ema_train + self._ema_score) * c.slowdown * 1000
        over = c.batch_budget_ms > 0 and predicted_ms > c.batch_budget_ms
        self.fw["over_budget"] += over
        self.client.skip_scoring = over and c.skip_scoring_over_budget
        self.fw["skipped_scoring"] += self.client.skip_scoring

    def _throttle(self) -> None:
        t = self.client.timings
        d = {k: t.get(k, 0.0) - self._timing0.get(k, 0.0) for k in t}
        score = d.get("score", 0.0)
        work = sum(d.values())
        self._ema_train = (1 - EMA) * self._ema_train + EMA * (work - score)
        if score > 0:
            self._ema_score = (1 - EMA) * self._ema_score + EMA * score
        pause = (self.profile.compute.slowdown - 1) * work
        if pause > 0:
            self.fw["throttle_s"] += pause
            if self.crash.wait(pause):
                raise Crash

    # -- status and results ---------------------------------------------------------------
    def clock(self) -> float:
        """The device's wall clock (skewed)."""
        return time.time() + self.skew_s

    def status_fields(self) -> dict[str, Any]:
        return {"clock": round(self.clock(), 3), "boots": self.fw["boots"],
                "profile": self.profile.name}

    def final_status(self, state: str, **extra) -> None:
        self.link.wait_connected(FINAL_WAIT_S)  # flush the last update before closing
        try:
            super().final_status(state, **extra)
        except TransportError as e:
            log.warning("%s: final status not acknowledged: %s", self.cid, e)

    def after_run(self, state: str) -> None:
        if not self.stop.is_set():
            self.done = True
            self.save()
            n = self._inbox_ids.pop(None, None)
            if n is not None:
                self.flash.inbox_drop(n)

    def result_fields(self) -> dict[str, Any]:
        link = self.link_totals + Counter(self.link.counters() if self.link else {})
        return {"profile": self.profile.name, "consumed": self.consumed, "link": dict(link),
                "firmware": dict(self.fw), "trained": dataclasses.asdict(self.trained),
                "flash_writes": self.flash.writes, "clock_skew_s": self.skew_s}
