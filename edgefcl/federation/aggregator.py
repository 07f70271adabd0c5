"""The Aggregator: validation, round scheduling, aggregation and versioning (no transport)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

import edgefcl.federation.apc  # noqa: F401  (registers the apc strategy)
import edgefcl.federation.gaussian  # noqa: F401  (registers the gaussian strategies)
import edgefcl.federation.sparse  # noqa: F401  (registers the sparse strategy)
from edgefcl.config import FedConfig
from edgefcl.federation.aggregation import make_strategy
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.federation.schedule import eligible
from edgefcl.federation.versions import GlobalHistory

log = logging.getLogger("edgefcl.aggregator")


@dataclass
class RoundClosed:
    """What closing a tick (sync) or a round (async) produced.

    `global_` is the new global model, or None when too few eligible updates came in (sync
    ticks always close and are answered, with or without a new global).
    """

    tick: int | None
    global_: GlobalModel | None
    participants: tuple[str, ...] = ()


@dataclass
class _Round:
    updates: list[Update] = field(default_factory=list)
    reported: set[str] = field(default_factory=set)
    opened_at: float | None = None


class Aggregator:
    """Validates updates, schedules rounds (lock-step ticks or async quorum + timeout),
    aggregates them and versions the global model.

    Lock-step (`mode="sync"`): every active client reports once per mini-batch (an Update when
    eligible, else a Tick). The tick closes when every active client has reported; the eligible
    updates are aggregated if there are at least `min_clients`, in client-id order so that the
    result does not depend on arrival order.
    Async: a round closes when `min_clients` updates are in and every active client has
    reported or `round_timeout` seconds passed (`poll`). Updates are folded into running sums on
    arrival, so memory does not grow with the number of clients.
    """

    def __init__(self, initial: Tensors, fed: FedConfig, version: int = 0) -> None:
        self.fed = fed
        self.global_ = GlobalModel(version, {k: np.asarray(v, np.float32) for k, v in
                                             initial.items()})
        self.spec = {k: v.shape for k, v in self.global_.tensors.items()}
        # the last globals, to rebuild sparse deltas and send delta downlinks (bounded)
        self.history = GlobalHistory(fed.max_staleness + 1)
        self.history.push(version, self.global_.tensors)
        self.active: set[str] = set()
        self.roster_complete = fed.mode == "async"
        self.last_seq: dict[str, int] = {}
        self.tick = 0
        self.rounds = 0
        self.counters: Counter[str] = Counter()
        self._round = _Round()
        self._acc = self._new_strategy()

    def _new_strategy(self):
        strategy = make_strategy(self.fed.encoding, self.fed.aggregation, self.fed.mix)
        if hasattr(strategy, "configure"):  # strategies that read more options
            strategy.configure(self.fed)
        if hasattr(strategy, "bind"):  # strategies that read the global history or spec
            strategy.bind(self)
        return strategy

    # -- membership -----------------------------------------------------------------------
    def join(self, client: str) -> None:
        """Add a client to the active set (it is expected to report)."""
        self.active.add(client)
        if len(self.active) >= self.fed.clients:
            self.roster_complete = True

    def leave(self, client: str, now: float | None = None) -> RoundClosed | None:
        """Remove a client (stream finished or went offline); may close the pending tick."""
        self.active.discard(client)
        return self._maybe_close(now)

    # -- input ----------------------------------------------------------------------------
    def validate(self, msg: Update | Tick) -> str | None:
        """The reason to reject `msg`, or None if it is acceptable."""
        if msg.seq <= self.last_seq.get(msg.client, -1):
            return "duplicate"
        if isinstance(msg, Tick):
            return None if self.fed.mode == "sync" else "tick-in-async"
        if msg.encoding != self._acc.encoding:
            return "encoding"
        reason = self._acc.check(msg, self.spec)
        if reason is not None:
            return reason
        if msg.num_samples < 1:
            return "samples"
        if not eligible(msg.batch, self.fed.burn_in, self.fed.jump):
            return "not-eligible"
        if self.fed.mode == "async" and self.global_.version - msg.base_version > \
                self.fed.max_staleness:
            return "stale"
        return None

    def submit(self, msg: Update | Tick, now: float | None = None) -> RoundClosed | None:
        """Take one report; returns what closed as a consequence, if anything."""
        reason = self.validate(msg)
        if reason is not None:
            self.counters[f"rejected_{reason}"] += 1
            log.warning("rejected %s from %s seq %s: %s", type(msg).__name__.lower(),
                        msg.client, msg.seq, reason)
            return None
        self.last_seq[msg.client] = msg.seq
        if msg.client not in self.active:
            self.join(msg.client)
        rnd = self._round
        if rnd.opened_at is None:
            rnd.opened_at = now
        if self.fed.mode == "sync" and msg.client in rnd.reported:
            self.counters["rejected_early"] += 1
            return None
        rnd.reported.add(msg.client)
        if isinstance(msg, Update):
            self.counters["accepted"] += 1
            if self.fed.mode == "sync":
                rnd.updates.append(msg)
            else:
                self._acc.add(msg)
                rnd.updates.append(Update(msg.client, msg.base_version, msg.seq, msg.task,
                                          msg.batch, msg.num_samples, {}))
        else:
            self.counters["ticks"] += 1
        return self._maybe_close(now)

    def poll(self, now: float) -> RoundClosed | None:
        """Async: close the round on quorum once `round_timeout` has passed."""
        return self._maybe_close(now)

    # -- rounds ---------------------------------------------------------------------------
    def _maybe_close(self, now: float | None) -> RoundClosed | None:
        rnd = self._round
        if self.fed.mode == "sync":
            if not self.roster_complete or not rnd.reported or not self.active <= rnd.reported:
                return None
            return self._close_tick()
        if len(rnd.updates) < self.fed.min_clients:
            return None
        timed_out = (now is not None and rnd.opened_at is not None
                     and now - rnd.opened_at >= self.fed.round_timeout)
        if self.active <= rnd.reported or timed_out:
            return self._close_round(None)
        return None

    def _close_tick(self) -> RoundClosed:
        self.tick += 1
        updates = sorted(self._round.updates, key=lambda u: u.client)
        if len(updates) >= self.fed.min_clients:
            for u in updates:
                self._acc.add(u)
            return self._close_round(self.tick)
        self._round = _Round()
        return RoundClosed(self.tick, None)

    def _close_round(self, tick: int | None) -> RoundClosed:
        participants = tuple(sorted(u.client for u in self._round.updates))
        tensors = self._acc.result(self.global_.tensors)
        self.counters.update(getattr(self._acc, "counters", {}))
        self.global_ = GlobalModel(self.global_.version + 1, tensors, participants)
        self.history.push(self.global_.version, tensors)
        self.rounds += 1
        self._round = _Round()
        self._acc = self._new_strategy()
        log.info("round %d closed: version %d, participants %s", self.rounds,
                 self.global_.version, ",".join(participants))
        return RoundClosed(tick, self.global_, participants)

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> dict:
        """What the daemon saves after every round (enough to resume)."""
        return {"version": self.global_.version, "tensors": self.global_.tensors,
                "participants": list(self.global_.participants), "tick": self.tick,
                "rounds": self.rounds, "last_seq": dict(self.last_seq),
                "counters": dict(self.counters)}

    def load_state(self, state: dict) -> None:
        """Resume from `state()` output."""
        self.global_ = GlobalModel(int(state["version"]), dict(state["tensors"]),
                                   tuple(state.get("participants", ())))
        self.history.clear()
        self.history.push(self.global_.version, self.global_.tensors)
        self.tick = int(state.get("tick", 0))
        self.rounds = int(state.get("rounds", 0))
        self.last_seq = {str(k): int(v) for k, v in state.get("last_seq", {}).items()}
        self.counters = Counter(state.get("counters", {}))
