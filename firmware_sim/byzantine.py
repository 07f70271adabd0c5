"""Byzantine devices: fleet members with valid identities that attack the aggregator.

`python -m firmware_sim fleet --devices N --byzantine K --attack NAME` adds K attackers
(`byz0`, `byz1`, ...) to the N honest devices; the roster admits all N + K. They train
nothing: once `ready()` (the launcher: 5 % of the streams consumed), every `period` seconds
each one builds its attack from the newest retained global
and publishes it on its own topics, as a device with a stolen credential could:

| attack        | what it sends                                                            |
|---------------|--------------------------------------------------------------------------|
| inflate       | an update near the global claiming num_samples = 10^12                   |
| scaled        | global + 100 x the last global change (or 100 x noise)                   |
| sign-flip     | global - 10 x the last global change                                     |
| noise         | global + Gaussian noise of each tensor's own scale                       |
| bn-var        | an update whose BatchNorm running variances are -1                       |
| bomb          | a map nested 500 deep on status/<id> (retained) and update/<id>          |
| stop          | `control stop` on update/<id>, and retained on status/<id>               |
| replay        | its first update again and again, each time with a new sequence number   |
| ghost         | statuses and updates from a new made-up id every period                  |
| chunk-flood   | first chunks of 4 MiB transfers that never complete                      |
| status-flood  | 300 statuses a second, each a list of 16,000 numbers (costly to scan)    |
| update-flood  | 20 valid updates a second near the global (20x an honest device's rate)  |
| tick-flood    | 100 lock-step ticks a second with sequence number -1                     |
| proto-bias    | prototype rows biased +1e6 toward one label, the others -1e6, huge counts|
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np

from edgefcl.config import RunConfig
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.federation.schedule import nth_eligible
from edgefcl.runtime.links import open_link, topics
from edgefcl.transport.chunks import split
from edgefcl.transport.codec import Message, decode, encode

ATTACKS = ("inflate", "scaled", "sign-flip", "noise", "bn-var", "bomb", "stop", "replay",
           "ghost", "chunk-flood", "status-flood", "update-flood", "tick-flood", "proto-bias")
FLOODS = {"status-flood": 300, "update-flood": 20, "tick-flood": 100}
"""Messages per period of each flooding attack."""


class _Attacker:
    """One Byzantine identity: its link, sequence counter and what it remembers."""

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.seq = 0
        self.first: Update | None = None
        self.link = None


class Byzantine:
    """K attacker identities running `attack` in a thread (see the module docstring)."""

    def __init__(self, cfg: RunConfig, k: int, attack: str, period: float = 1.0,
                 seed: int = 0, ready: Callable[[], bool] = lambda: True) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")
        self.cfg, self.attack, self.period, self.ready = cfg, attack, period, ready
        self.tp = topics(cfg.mqtt)
        self.rng = np.random.default_rng(seed)
        self.attackers = [_Attacker(f"byz{i}") for i in range(k)]
        self.sent: Counter[str] = Counter()
        self.globals: list[GlobalModel] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ids(self) -> list[str]:
        return [a.cid for a in self.attackers]

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        for a in self.attackers:
            a.link = open_link(self.cfg.mqtt, f"{self.cfg.mqtt.fleet}-{a.cid}", clean_start=True)
        self.attackers[0].link.subscribe(self.tp.global_, self._on_global, qos=0)
        self._thread = threading.Thread(target=self._loop, name="byzantine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for a in self.attackers:
            if a.link is not None:
                a.link.close()

    def _on_global(self, topic: str, payload: bytes) -> None:
        try:
            g = decode(payload, self.cfg.mqtt.fleet)
        except Exception:  # noqa: BLE001  (an attacker does not care)
            return
        if isinstance(g, GlobalModel):
            with self._lock:
                if not self.globals or g.version > self.globals[-1].version:
                    self.globals = [*self.globals[-1:], g]

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                globals_ = list(self.globals)
            if not globals_ or not self.ready():  # attack once the honest fleet is running
                continue
            for a in self.attackers:
                try:
                    for topic, payload, retain in self._payloads(a, globals_):
                        a.link.publish(topic, payload, qos=1, retain=retain)
                        self.sent[self.attack] += 1
                except Exception:  # noqa: BLE001  (a broken attacker must not stop the fleet)
                    self.sent["attacker_errors"] += 1

    # -- attacks --------------------------------------------------------------------------
    def _update(self, a: _Attacker, g: GlobalModel, tensors: Tensors, n: int | None = None,
                cid: str | None = None) -> Update:
        a.seq += 1
        f, d = self.cfg.fed, self.cfg.data
        batch = nth_eligible(a.seq, f.burn_in, f.jump)  # one the schedule and admission allow
        n = n if n is not None else batch * d.batch_size
        return Update(cid or a.cid, g.version, a.seq, 0, batch, n, tensors,
                      class_counts={0: n})

    def _change(self, globals_: list[GlobalModel]) -> Tensors:
        g = globals_[-1].tensors
        if len(globals_) < 2:
            return {k: self.rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in g.items()}
        prev = globals_[-2].tensors
        return {k: (g[k] - prev[k]).astype(np.float32) for k in g}

    def _payloads(self, a: _Attacker,
                  globals_: list[GlobalModel]) -> list[tuple[str, bytes, bool]]:
        g = globals_[-1]
        fleet = self.cfg.mqtt.fleet
        t = g.tensors
        up = self.tp.update(a.cid)

        def enc(msg: Any) -> bytes:
            return encode(msg, fleet=fleet)

        builders: dict[str, Callable[[], list[tuple[str, bytes, bool]]]] = {
            "inflate": lambda: [(up, enc(self._update(a, g, self._near(t), n=10**12)), False)],
            "scaled": lambda: [(up, enc(self._update(a, g, self._plus(t, self._change(globals_),
                                                                      100.0))), False)],
            "sign-flip": lambda: [(up, enc(self._update(a, g, self._plus(
                t, self._change(globals_), -10.0))), False)],
            "noise": lambda: [(up, enc(self._update(a, g, {
                k: (v + self.rng.normal(0, float(v.std()) + 1e-3, v.shape)).astype(np.float32)
                for k, v in t.items()})), False)],
            "bn-var": lambda: [(up, enc(self._update(a, g, {
                k: (-np.ones_like(v) if k.endswith("running_var") else v)
                for k, v in self._with_variance(t).items()})), False)],
            "bomb": lambda: [(self.tp.status(a.cid), self._bomb(a.cid), True),
                             (up, self._bomb(a.cid), False)],
            "stop": lambda: [(up, self._stop_cmd(a.cid), False),
                             (self.tp.status(a.cid), self._stop_cmd(a.cid), True)],
            "replay": lambda: [(up, enc(self._replay(a, g)), False)],
            "ghost": lambda: self._ghost(a, g),
            "chunk-flood": lambda: [(up, split(bytes(4 << 20), 1 << 16, secrets.token_hex(8))[0],
                                     False) for _ in range(8)],
            "status-flood": lambda: [(self.tp.status(a.cid), enc(Message(
                "status", {"state": "online", "pad": [7] * 16_000}, sender=a.cid)), False)
                for _ in range(FLOODS["status-flood"])],
            "update-flood": lambda: [(up, enc(self._update(a, g, self._near(t))), False)
                                     for _ in range(FLOODS["update-flood"])],
            "tick-flood": lambda: [(up, enc(Tick(a.cid, -1, 0, 1)), False)
                                   for _ in range(FLOODS["tick-flood"])],
            "proto-bias": lambda: [(up, enc(replace(self._update(a, g, self._near(t)),
                                                    prototypes=self._biased(g))), False)],
        }
        return builders[self.attack]()

    @staticmethod
    def _biased(g: GlobalModel, label: int = 0) -> LabelRows:
        """The global's library (four labels of width 4 without one) with every row's last
        entry (its bias) +1e6 for `label` and -1e6 for the others, and counts of 10^9."""
        lib = g.prototypes
        if lib is None or not lib.labels:
            lib = LabelRows(("0", "1", "2", "3"), np.zeros((4, 4), np.float32),
                            np.ones(4, np.int64))
        rows = np.array(lib.rows, np.float32, copy=True)
        rows[:, -1] = -1e6
        rows[min(label, len(rows) - 1), -1] = 1e6
        sigmas = None if lib.sigmas is None else np.array(lib.sigmas, np.float32)
        return LabelRows(lib.labels, rows, np.full(len(rows), 10**9, np.int64), sigmas)

    def _near(self, t: Tensors) -> Tensors:
        return {k: (v + self.rng.normal(0, 1e-3, v.shape)).astype(np.float32) for k, v in t.items()}

    @staticmethod
    def _plus(t: Tensors, d: Tensors, s: float) -> Tensors:
        """t + s * d on the learned tensors (BatchNorm statistics kept valid, so that only the
        robust rules, not the variance check, can stop it)."""
        with np.errstate(over="ignore"):
            return {k: (t[k] if k.endswith(("running_var", "running_mean"))
                        else (t[k] + s * d[k]).astype(np.float32)) for k in t}

    @staticmethod
    def _with_variance(t: Tensors) -> Tensors:
        """The global's tensors; a model without BatchNorm gets a made-up variance tensor
        (rejected as an unknown name instead)."""
        if any(k.endswith("running_var") for k in t):
            return t
        return {**t, "bn.running_var": np.ones(4, np.float32)}

    def _bomb(self, cid: str) -> bytes:
        inner: Any = {"state": "online"}
        for _ in range(500):
            inner = {"x": inner}
        return msgpack.packb({"schema": 1, "kind": "status", "fleet": self.cfg.mqtt.fleet,
                              "sender": cid, "x": inner})

    def _stop_cmd(self, cid: str) -> bytes:
        return encode(Message("control", {"command": "stop"}, sender=cid),
                      fleet=self.cfg.mqtt.fleet)

    def _replay(self, a: _Attacker, g: GlobalModel) -> Update:
        if a.first is None:
            a.first = self._update(a, g, self._near(g.tensors))
            return a.first
        a.seq += 1
        f = a.first
        return Update(f.client, f.base_version, a.seq, f.task, f.batch, f.num_samples,
                      f.tensors, class_counts=f.class_counts)

    def _ghost(self, a: _Attacker, g: GlobalModel) -> list[tuple[str, bytes, bool]]:
        ghost = f"ghost-{secrets.token_hex(4)}"
        status = encode(Message("status", {"state": "online"}, sender=ghost),
                        fleet=self.cfg.mqtt.fleet)
        ghost_attacker = _Attacker(ghost)
        upd = self._update(ghost_attacker, g, self._near(g.tensors), cid=ghost)
        return [(self.tp.status(ghost), status, True),
                (self.tp.update(ghost), encode(upd, fleet=self.cfg.mqtt.fleet), False)]
