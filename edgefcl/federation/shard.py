"""Sharded aggregation without transport: workers fold a share of the updates into partial
aggregates, the root merges the partials and owns versions and the schedule.

A worker (`ShardWorker`) runs every boundary check of the single aggregator (admission,
encoding validation, staleness, eligibility) on the updates it gets, keeps at most one update
per client (the newest), and at each flush applies the robust round rules to its share,
folds it in client-id order and returns a `Partial`: the strategy's `partial()` plus the
participants and their sequence numbers.

Before a flush the worker claims its clients (`ShardWorker.claimable`, `ShardRoot.claim`): the
root grants those not yet in the open round nor granted to another worker, and the worker folds
only the granted ones (`flush(granted)`); the others stay at the worker, newest per client, for
a later round. So a client whose updates reach two workers in one round (a device that sends
faster than rounds close, as a flooding one does) is held back alone, not with the honest
updates of a whole partial.

The root (`ShardRoot`) merges partials in arrival order into one strategy (each partial is a
sum, so the order changes only float64 rounding), never lets a client count twice in a round
(a partial naming a client already in the round, or granted to another worker, waits whole for
the next round: with claims this happens only when a grant outlived its round), and closes a
round once its distinct participants reach `min_clients` and the quorum's share of the active
devices (as a single aggregator's round; without the quorum two ids whose partials came first
owned a round among 102 active devices) and either every live worker has claimed or sent a
partial since the round opened and every grant has come back as a partial, or
`round_timeout` seconds passed after its first partial: a dead worker delays a round by at
most the timeout.

Each process keeps one long-lived strategy (the Aggregator's), as the single aggregator does:
a worker opens a round on it (`configure_round`) at every flush, adds its share's decoded
updates and hands `partial()` on; the root opens a round when the previous one closes, folds
the partials in with `merge()` and calls `result()` once when it closes.

Only rules with `decomposable = True` can be sharded (FedAvg and class-weighted over every
dense-form encoding, dense and q8; conflation, moments; sparse FedAvg). Robust rules that
look at the whole round run per shard: clipping by the shard's median norm and the share cap
among the shard's participants (with all rules off, a sharded round equals the
single-aggregator round up to float64 rounding); class-weighted shards only with the cap off,
as its cap needs the round's class totals.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.aggregator import (
    Aggregator,
    RoundClosed,
    _Round,
    decode_updates,
    note_round,
)
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import GlobalModel, Tensors
from edgefcl.federation.registry import get_encoding
from edgefcl.federation.robust import prepare_round
from edgefcl.federation.share_cap import capped_member_columns, default_cap
from edgefcl.federation.strategy import RoundInput

log = logging.getLogger("edgefcl.shard")

MAX_DEFERRED = 64
"""Partials the root holds for the next round (their clients were already in this one)."""
DEFERRED_MODELS = 64
"""What the held partials may weigh together, in float64 copies of the global, at least
DEFERRED_FLOOR bytes (partials padded with extra tensors, 16 of 42 MiB, held 672 MiB for a
1 MiB model; 64 of the root's 64 MiB payload limit would be 4 GiB)."""
DEFERRED_FLOOR = 16 << 20
MAX_WORKER_COUNTERS = 256
"""Distinct counter names the root takes from its workers beyond its own: more are left
out (6,000 invented names per partial grew its status past what devices decode)."""


def state_bytes(state: object) -> int:
    """Bytes of the arrays a partial's (nested) state holds."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    return int(state.nbytes) if isinstance(state, np.ndarray) else 0


class ShardError(ValueError):
    """A configuration that cannot be sharded (the message says why)."""


def check_shardable(fed: FedConfig, prototypes: LabelRows | None = None) -> None:
    """Raise ShardError unless rounds of `fed` (its encoding's rule `fed.aggregation`) can be
    split over workers; a run with a prototype library (`prototypes`) cannot yet (partials
    carry no library)."""
    if prototypes is not None:
        raise ShardError("head prototypes does not shard yet (partials carry no prototype "
                         "library); run it with --role single")
    if fed.mode != "async":
        raise ShardError("sharded aggregation runs async rounds only (--mode async); "
                         "lock-step needs every report at one aggregator")
    rule = get_encoding(fed.encoding).rules.get(fed.aggregation)
    if rule is None or not rule.decomposable:
        raise ShardError(f"aggregation '{fed.aggregation}' ({fed.encoding}) does not decompose "
                         "into partial sums; run it with --role single")
    if rule.weights_by_class and fed.max_share < 1:
        raise ShardError(f"aggregation '{fed.aggregation}' caps each update's share of the "
                         "class models, which needs the whole round; shard it with "
                         "--max-share 1 (no cap) or run it with --role single")


@dataclass
class Partial:
    """One worker's share of a round: a strategy partial and who is in it."""

    worker: str
    version: int
    """The global version the worker held when it flushed (its updates' staleness was
    checked against it)."""
    participants: tuple[str, ...]
    seqs: dict[str, int]
    state: dict
    counters: dict[str, int] = field(default_factory=dict)


class ShardWorker(Aggregator):
    """An Aggregator that never closes rounds itself: `flush()` turns what it accepted into a
    Partial for the root; `set_global` takes the root's new globals."""

    def __init__(self, initial: Tensors, fed: FedConfig, version: int = 0,
                 batch_size: int | None = None, worker: str = "worker",
                 prototypes: LabelRows | None = None) -> None:
        check_shardable(fed, prototypes)
        super().__init__(initial, fed, version, batch_size)
        self.worker = worker

    spills = False  # a full worker flushes instead
    keeps_decoded = True  # and its flush holds the bound
    carries = False  # the root closes the task gate's round

    def _maybe_close(self, now: float | None) -> RoundClosed | None:
        return None  # the root closes rounds

    def _close_now(self, now: float | None) -> RoundClosed | None:
        return None  # the task gate's round too

    def set_global(self, g: GlobalModel) -> bool:
        """Take a newer global from the root (staleness and sparse bases are checked against
        it); False for one not newer than the current."""
        if g.version <= self.global_.version:
            return False
        self.global_ = GlobalModel(g.version, dict(g.tensors), tuple(g.participants))
        self.history.push(g.version, self.global_.tensors)
        return True

    def pending(self) -> int:
        """Updates waiting for the next flush."""
        return len(self._round.updates)

    def flush_due(self, now: float, interval: float) -> bool:
        """`interval` s after the first update held, or at once when the updates held reach
        `round_max_mib` (the worker's memory stays bounded whatever the rate)."""
        rnd = self._round
        if not rnd.updates:
            return False
        if self._round_full():
            return True
        return rnd.opened_at is not None and now - rnd.opened_at >= interval

    def claimable(self) -> tuple[str, ...]:
        """The clients whose updates wait for the next flush, to claim from the root."""
        return tuple(sorted(self._round.updates))

    def flush(self, granted: Collection[str] | None = None,
              now: float | None = None) -> Partial | None:
        """The partial of the updates accepted since the last flush (None if none): of the
        `granted` clients only when given, the others' updates stay for a later flush (due
        `flush_every` after `now` when given, so that they are not claimed again at once)."""
        rnd = self._round
        take = sorted(rnd.updates if granted is None else set(rnd.updates) & set(granted))
        self._round = _Round()
        if len(take) < len(rnd.updates):  # the rest wait, as they were
            kept = {c: u for c, u in rnd.updates.items() if c not in take}
            self._round = _Round(kept, opened_at=rnd.opened_at if now is None else now,
                                 arrived=len(kept),
                                 nbytes=sum(u.nbytes for u in kept.values()))
            self.counters["held_for_later_round"] += len(self._round.updates)
        if not take:
            return None
        c: Counter[str] = Counter()
        decoded = self.folded(decode_updates(self.encoding, [rnd.updates[p] for p in take], c))
        if not decoded:
            self.counters.update(c)
            return None
        participants = tuple(u.client for u in decoded)
        self.strategy.configure_round(RoundInput(self.global_.version, self.global_.tensors,
                                                 self.history.get, participants))
        updates = prepare_round(self.weighed(decoded), self.global_.tensors, self.fed, c,
                                self.encoding.form, self.rule_memory,
                                self.strategy)
        note_round(updates, self.global_.version, c, whole=False)
        for u in updates:
            self.strategy.add(u)
        c.update(self.strategy.counters())
        self.counters.update(c)
        part = Partial(self.worker, self.global_.version, participants,
                       {p: rnd.updates[p].seq for p in participants}, self.strategy.partial(),
                       dict(c))
        self.rounds += 1
        return part


class ShardRoot(Aggregator):
    """An Aggregator whose rounds are built from workers' partials (`merge`).

    Its strategy's round is opened when the previous one closes (`RoundInput.participants` is
    empty then: the participants come with the partials), partials are merged into it, and
    `result()` is called once when the round closes."""

    def __init__(self, initial: Tensors, fed: FedConfig, version: int = 0,
                 batch_size: int | None = None, prototypes: LabelRows | None = None,
                 row_prior_sigma: float | None = None, wire_dtype: str | None = None) -> None:
        check_shardable(fed, prototypes)  # no library: `row_prior_sigma` is never needed
        super().__init__(initial, fed, version, batch_size, wire_dtype=wire_dtype)
        self._open_round()
        self.live_workers: set[str] = set()
        self.reported: set[str] = set()
        self.in_round: dict[str, int] = {}
        """client -> seq of its update merged into the open round."""
        self.granted: dict[str, str] = {}
        """client -> the worker whose partial of the open round may hold it (`claim`)."""
        self.deferred: list[Partial] = []
        self.worker_counters: set[str] = set()
        """Counter names taken from workers (at most MAX_WORKER_COUNTERS)."""
        self._deferred_budget = max(DEFERRED_FLOOR, DEFERRED_MODELS * 8 * sum(
            int(np.size(t)) for t in initial.values()))
        self._merged: list[Partial] = []

    def _deferred_bytes(self) -> int:
        return sum(state_bytes(p.state) for p in self.deferred)

    def load_state(self, state: dict) -> None:
        """Resume from `state()` output; the open round starts over on the loaded global."""
        super().load_state(state)
        self._open_round()

    def check_partial(self, p: Partial) -> str | None:
        """The reason to reject a well-formed partial, or None."""
        if p.version > self.global_.version or p.version < 0:
            return "base"
        if self.global_.version - p.version > self.fed.max_staleness:
            return "stale"
        if not p.participants or len(set(p.participants)) != len(p.participants):
            return "participants"
        if len(p.participants) > self.admission.cap:
            return "participants"
        if any(not self.admission.may_join(c) for c in p.participants):
            return "roster"
        return None

    def claim(self, worker: str, clients: Sequence[str]) -> tuple[str, ...]:
        """Grant `worker` the `clients` (distinct, at most the admission cap) that are on the
        roster or fit on it, and are not in the open round nor granted to another worker: its
        next partial may hold them. The rest are counted as `claims_held` and wait at the
        worker for a later round. A claim counts as the worker's report for the round, and
        answers its earlier grants: what it did not send with them, it dropped."""
        self.reported.add(worker)
        self._drop_grants(worker)
        out = []
        for c in list(dict.fromkeys(clients))[:self.admission.cap]:
            if c in self.in_round or self.granted.get(c, worker) != worker \
                    or not self.admission.admit(c):  # the roster learns it here
                continue
            self.granted[c] = worker
            out.append(c)
        self.counters["claims_held"] += len(clients) - len(out)
        return tuple(out)

    def merge(self, p: Partial, now: float | None = None) -> str | None:
        """Merge a partial into the open round (or hold it for the next one when one of its
        clients is already in this round or granted to another worker); returns a rejection
        reason or None."""
        reason = self.check_partial(p)
        if reason is not None:
            self.counters[f"rejected_partial_{reason}"] += 1
            return reason
        self.reported.add(p.worker)
        if set(p.participants) & set(self.in_round) or any(
                self.granted.get(c, p.worker) != p.worker for c in p.participants):
            if len(self.deferred) >= MAX_DEFERRED or (
                    self._deferred_bytes() + state_bytes(p.state) > self._deferred_budget):
                self.counters["rejected_partial_deferred_full"] += 1
                return "deferred_full"
            self.deferred.append(p)
            self.counters["partials_deferred"] += 1
            return None
        return self._merge_now(p, now)

    def _open_round(self) -> None:
        """Open the strategy's round on the current global (no partial merged yet)."""
        self.strategy.configure_round(RoundInput(self.global_.version, self.global_.tensors,
                                                 self.history.get))

    def _merge_now(self, p: Partial, now: float | None) -> str | None:
        try:
            self.strategy.merge(p.state)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._rebuild()  # a merge that failed half-way leaves no trace
            self.counters["rejected_partial_structure"] += 1
            log.warning("rejected partial of %s: %s", p.worker, e)
            return "structure"
        if self._round.opened_at is None:
            self._round.opened_at = now
        for c in p.participants:
            self.granted.pop(c, None)
            self.in_round[c] = p.seqs.get(c, 0)
            self.admission.admit(c)
            self.heard_from(c, now, rejoin=False)  # its report, taken at the worker
            self.admission.last_seq[c] = max(self.admission.last_seq.get(c, 0),
                                             int(p.seqs.get(c, 0)))
        self._drop_grants(p.worker)  # a partial answers its worker's grant: the rest dropped
        self._merged.append(p)
        self.counters["accepted"] += len(p.participants)
        self.counters["partials"] += 1
        for name, n in p.counters.items():  # a worker cannot grow the root's status unbounded
            if name in self.counters or len(self.worker_counters) < MAX_WORKER_COUNTERS:
                self.worker_counters.add(name)
                self.counters[name] += n
        return None

    def _rebuild(self) -> None:
        """Reopen the strategy's round with only the partials merged so far."""
        self._open_round()
        for q in self._merged:
            self.strategy.merge(q.state)

    def _maybe_close(self, now: float | None) -> RoundClosed | None:
        if len(self.in_round) < max(self.fed.min_clients, 1, self._quorum()):
            return None  # the quorum: two ids whose partials came first owned the round
        rnd = self._round
        timed_out = (now is not None and rnd.opened_at is not None
                     and now - rnd.opened_at >= self.fed.round_timeout)
        if (self.live_workers <= self.reported and not self.granted) or timed_out:
            return self._close_merged(now)
        return None

    def _round_clients(self) -> int:
        return len(self.in_round)

    def _population(self) -> int:
        return len(self.active) + len(self.in_round.keys() - self.active)

    def _close_now(self, now: float | None) -> RoundClosed | None:
        return self._close_merged(now)

    def _cap_partials(self) -> None:
        """The share cap across partials: each partial's weights (`partial_weights`: samples,
        or precision entry by entry, as a single aggregator caps) spread over its
        participants, no participant may hold more than `max_share` of a weight (0:
        `default_cap` of them), and a partial over it has that weight lowered to what its
        participants may hold (`partials_share_capped`). A worker caps the updates of one
        flush only, so a device alone in a flush (a site with one device, a flush of one) was
        capped by nothing: its sample count or sigma owned the global."""
        if self.fed.max_share >= 1 or len(self._merged) < 2:
            return
        weights = [self.strategy.partial_weights(p.state) for p in self._merged]
        if any(w is None for w in weights):
            return
        sizes = np.asarray([len(p.participants) for p in self._merged], np.float64)
        cap = self.fed.max_share or default_cap(int(sizes.sum()))
        factors: list[dict[str, np.ndarray]] = [{} for _ in self._merged]
        for name in sorted({n for w in weights for n in w}):
            have = [i for i, w in enumerate(weights) if name in w]
            if len(have) < 2:
                continue
            per_member = np.stack([weights[i][name] for i in have]) / sizes[have, None]
            capped = capped_member_columns(per_member, sizes[have], cap)
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(per_member > 0, capped / per_member, 1.0)
            for i, f in zip(have, scale, strict=True):
                if (f < 1.0 - 1e-12).any():
                    factors[i][name] = np.minimum(f, 1.0)
        lowered = [i for i, f in enumerate(factors) if f]
        if not lowered:
            return
        self.counters["partials_share_capped"] += len(lowered)
        self._open_round()
        for p, f in zip(self._merged, factors, strict=True):
            self.strategy.merge(self.strategy.scale_partial(p.state, f) if f else p.state)

    def _close_merged(self, now: float | None) -> RoundClosed:
        participants = tuple(sorted(self.in_round))
        seqs = dict(sorted(self.in_round.items()))
        self._cap_partials()
        tensors, server = self.published(self.strategy.result(self.server_global()))
        self.counters.update(self.strategy.counters())
        candidate = GlobalModel(self.global_.version + 1, tensors, participants,
                                counted={c: s for c, s in seqs.items() if s >= 1})
        if self._rejects_global(candidate):  # as a single aggregator
            closed = RoundClosed(None, None)
        else:
            self.global_, self._server = candidate, server
            self.history.push(self.global_.version, tensors)
            self.rounds += 1
            log.info("round %d closed from partials: version %d, %d participants", self.rounds,
                     self.global_.version, len(participants))
            closed = RoundClosed(None, self.global_, participants, seqs)
        self._reset_round()
        held, self.deferred = self.deferred, []
        for p in held:  # what waited for this round, in arrival order
            self.merge(p, now)
        return closed

    def drop_round(self) -> None:
        """Discard the open round: the merged partials and who is in it (counted as
        `dropped_round` and `dropped_updates`), as closing it would have reset them."""
        self.counters["dropped_round"] += 1
        self.counters["dropped_updates"] += len(self.in_round)
        self._reset_round()

    def _reset_round(self) -> None:
        self._round = _Round()
        self._open_round()
        self._merged = []
        self.in_round = {}
        self.granted = {}
        self.reported = set()

    def worker_online(self, worker: str) -> None:
        self.live_workers.add(worker)

    def worker_offline(self, worker: str, now: float | None = None) -> RoundClosed | None:
        """A worker left (its last will): the open round no longer waits for it or its
        grants."""
        self.live_workers.discard(worker)
        return self.release_grants(worker, now)

    def release_grants(self, worker: str, now: float | None = None) -> RoundClosed | None:
        """The open round no longer waits for `worker`'s grants (its partial was rejected, or
        it left): a later partial of it may still hold them."""
        self._drop_grants(worker)
        return self._maybe_close(now)

    def _drop_grants(self, worker: str) -> None:
        """Forget `worker`'s grants (`grants_released` counts them)."""
        held = {c: w for c, w in self.granted.items() if w != worker}
        self.counters["grants_released"] += len(self.granted) - len(held)
        self.granted = held
