"""The Aggregator: validation, round scheduling, aggregation and versioning (no transport)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from edgefcl.config import ConfigError, FedConfig
from edgefcl.federation.admission import Admission
from edgefcl.federation.encodings import Encoding
from edgefcl.federation.folds import FOLDS, Fold
from edgefcl.federation.global_check import published_fault
from edgefcl.federation.heads import RowsRule, rows_rule
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import GlobalModel, Tensors, Tick, Update
from edgefcl.federation.registry import get_encoding, get_rule
from edgefcl.federation.robust import check_variances, copy_memory, load_memory, prepare_round
from edgefcl.federation.round_weights import weigh
from edgefcl.federation.schedule import eligible
from edgefcl.federation.sparse_global import sparse_step
from edgefcl.federation.strategy import RoundInput, Strategy
from edgefcl.federation.task_ends import TaskEnds
from edgefcl.federation.task_gate import OPEN, TaskGate
from edgefcl.federation.versions import GlobalHistory

log = logging.getLogger("edgefcl.aggregator")

BUFFER_FLEET = 100
"""Active devices from which an async round with `buffer` 0 closes on half of them
(`buffer_size`)."""


def buffer_size(fed: FedConfig, active: int) -> int:
    """Updates after which an open async round closes (FedBuff's K; 0: never): `fed.buffer`
    when set (-1: never), else half the `active` devices (`Aggregator._population`) once they
    are BUFFER_FLEET or more.
    A round that waits for every one of 1,000 devices lasts a whole send period of the last
    one, and the others' newer updates replace theirs in it meanwhile (1,000 sparse devices
    at 2x over the broker with backpressure: 0.71 and 0.85 of the capacity folded; with
    rounds of 500, 1.00). Small fleets, whose rounds the async study measured, are unchanged."""
    if fed.buffer:
        return max(fed.buffer, 0)
    return math.ceil(active / 2) if active >= BUFFER_FLEET else 0


@dataclass
class RoundClosed:
    """What closing a tick (sync) or a round (async) produced.

    `global_` is the new global model, or None when too few eligible updates came in (sync
    ticks always close and are answered, with or without a new global).
    """

    tick: int | None
    global_: GlobalModel | None
    participants: tuple[str, ...] = ()
    seqs: dict[str, int] = field(default_factory=dict)
    """Sequence number of each participant's update (what the round counted)."""
    carried: dict[str, int] = field(default_factory=dict)
    """The task gate's round: sequence number of each end-of-task update an earlier round
    counted, held again so that every device's end-of-task model is in it (`task_ends.py`)."""


@dataclass
class _Round:
    updates: dict[str, Update] = field(default_factory=dict)
    """At most one update per client: a newer one replaces it."""
    reported: set[str] = field(default_factory=set)
    opened_at: float | None = None
    nbytes: int = 0
    """Bytes of the tensors of `updates` (async rounds close at `round_max_mib`)."""
    arrived: int = 0
    """Updates accepted into the round, replaced ones included (`buffer` counts them, but a
    round closes on them only with the quorum's clients in it, or K when fewer: one device's
    resent updates alone closed rounds of two among 102 active devices)."""
    carried: dict[str, int] = field(default_factory=dict)
    """client -> seq of an end-of-task update a past round counted, held for the task gate's
    round (`TaskEnds`); not counted again."""
    spilled: dict[str, int] = field(default_factory=dict)
    """client -> seq of its update already folded into the strategy (`Aggregator._spill`);
    a newer update of such a client in `updates` waits for the next round."""

    def clients(self) -> int:
        """Distinct clients in the round, folded or held."""
        return len(self.spilled) + sum(c not in self.spilled for c in self.updates)


def round_spills(fed: FedConfig, library: bool) -> bool:
    """Whether a full async round of `fed` below `min_clients` can fold what it holds early
    (as a shard worker's flush): a decomposable rule, no prototype `library`, no class share
    cap. Rounds of other rules hold every update until they close."""
    rule = get_rule(fed)
    return (fed.mode == "async" and rule.decomposable and not library
            and not (rule.weights_by_class and fed.max_share < 1))


def decode_updates(encoding: Encoding, updates: list[Update], counters: Counter) -> list[Update]:
    """The updates with dense tensors, decoded by `encoding`; an update it cannot decode (a
    gap in its validator, reached by input) is dropped and counted as `rejected_decode`,
    never the round."""
    out = []
    for u in updates:
        try:
            decoded = replace(u, tensors=encoding.decode(u.tensors))
        except Exception as e:  # any encoding's decoder: a payload its validator let through
            counters["rejected_decode"] += 1
            log.warning("dropped the update of %s seq %s: its %s payload does not decode (%s)",
                        u.client, u.seq, encoding.name, type(e).__name__,
                        extra={"device": u.client})
            continue
        if encoding.form == "dense" and check_variances(decoded.tensors) is not None:
            counters["rejected_variance"] += 1  # a variance under an encoded name (q8 codes)
            log.warning("dropped the update of %s seq %s: a BatchNorm variance <= 0 once "
                        "decoded", u.client, u.seq, extra={"device": u.client})
            continue
        out.append(decoded)
    return out


def get_fold(name: str) -> Fold:
    """The fold rule `name`; ConfigError listing the rules otherwise."""
    fold = FOLDS.get(name)
    if fold is None:
        raise ConfigError(f"unknown fold '{name}'; choose from {', '.join(FOLDS)}")
    return fold


STALENESS_KEYS = 64
"""The staleness counted as itself; an update more versions behind (a lock-step device may
claim any base) counts as this many: one key a claim made the counters grow without bound."""


def note_round(updates: list[Update], version: int, counters: Counter,
               whole: bool = True) -> None:
    """Count what a round folds: its size (`round_size_<n>`, unless not `whole`: a shard
    worker's part) and each update's staleness, the versions between its base and the global
    it replaces (`folded_staleness_<tau>`, at most STALENESS_KEYS, and their sum uncapped in
    `folded_staleness_sum` over `folded_staleness_summed` updates); the same counters in
    process and over MQTT (`async_stats` summarises them)."""
    if whole:
        counters[f"round_size_{len(updates)}"] += 1
    for u in updates:
        tau = max(version - u.base_version, 0)
        counters[f"folded_staleness_{min(tau, STALENESS_KEYS)}"] += 1
        counters["folded_staleness_sum"] += tau
        counters["folded_staleness_summed"] += 1


def async_stats(counters: dict) -> dict:
    """Rounds, updates per round and staleness of the folded updates (mean and histogram),
    what was dropped, rounds closed by the buffer and by the task gate, and end-of-task
    updates the gate's rounds carried (counted in the staleness too), from an aggregator's
    counters."""
    def hist(prefix: str) -> dict[int, int]:
        return {int(k[len(prefix):]): int(v) for k, v in sorted(counters.items())
                if k.startswith(prefix) and k[len(prefix):].isdigit()}

    sizes, stale = hist("round_size_"), hist("folded_staleness_")
    rounds, folded = sum(sizes.values()), sum(stale.values())

    def mean(h: dict[int, int], n: int) -> float:
        return round(sum(k * v for k, v in h.items()) / n, 3) if n else 0.0

    return {"rounds": rounds, "folded": folded, "updates_per_round": mean(sizes, rounds),
            "round_sizes": sizes,
            # the uncapped sum where it covers every update (not in a state saved before it)
            "staleness_mean": round(counters["folded_staleness_sum"] / folded, 3)
            if folded and counters.get("folded_staleness_summed") == folded
            else mean(stale, folded),
            "staleness": stale, "dropped_stale": int(counters.get("rejected_stale", 0)),
            "replaced": int(counters.get("replaced", 0)),
            "closed_buffer": int(counters.get("closed_buffer", 0)),
            "closed_gate": int(counters.get("closed_gate", 0)),
            "carried": int(counters.get("carried", 0))}


class Aggregator:
    """Validates updates, schedules rounds (lock-step ticks or async quorum + timeout),
    aggregates them and versions the global model.

    Lock-step (`mode="sync"`): every active client reports once per mini-batch (an Update when
    eligible, else a Tick). The tick closes when every active client has reported; the eligible
    updates are aggregated if there are at least `min_clients`, in client-id order so that the
    result does not depend on arrival order.
    Async: a round closes when `min_clients` updates are in and every active client has
    reported, or once `round_timeout` seconds passed (`poll`) and the updates also come from
    at least a `quorum` share of the active clients (so that `min_clients` clients that report
    first cannot own a round; clients that leave or go silent stop counting), or as soon as
    the updates it holds reach `round_max_mib` (a buffer that bounds memory under load) with
    the quorum's clients in it (below the quorum a rule that can folds what the round holds
    into its strategy and frees it, `_spill`; the others close with `min_clients`), or once
    `buffer` updates came in (FedBuff's K, `buffer_size`) from the quorum's share of the
    clients, or K of them when that is fewer (so that one device's resent updates cannot close
    it). The quorum and K are shares of the active clients and of those whose updates the
    round holds (`_population`). A round keeps at most one update per client (a newer one
    replaces the older) and the quorum counts distinct clients; the updates are aggregated in
    client-id order when the round closes.

    An update the daemon had to shed unread counts as reported (`lost`).

    Every report first passes `Admission` (roster, sequence, batch, base version, sample and
    class counts); `batch_size` (of the data stream) bounds the samples an update may claim.
    """

    def __init__(self, initial: Tensors, fed: FedConfig, version: int = 0,
                 batch_size: int | None = None,
                 prototypes: LabelRows | None = None,
                 row_prior_sigma: float | None = None,
                 wire_dtype: str | None = None) -> None:
        self.fed = fed
        self.wire_dtype = wire_dtype
        """The dtype globals travel in (None: as they are): a global it cannot carry, as
        devices would decode it, is never made a version."""
        self.row_prior_sigma = row_prior_sigma
        """The prior sigma of a new label's Gaussian row (the devices' `bayes_sigma`): the
        fedbnn rule multiplies it by the row's likelihoods."""
        self._rows: RowsRule = rows_rule()
        """The library head's rule: checks a device's rows, folds the round's library."""
        self._server: Tensors | None = None
        """The model rounds fold into while sparse globals hold part of it back (`--global-topk`,
        `federation/sparse_global.py`); None: the published global."""
        self._whole_global = False
        """The round closing now publishes its result whole, nothing held back (the task
        gate's round: the global every device evaluates the task on)."""
        if self._rows_by_likelihood(prototypes) and row_prior_sigma is None:
            raise ValueError("fedbnn with Gaussian prototype rows needs row_prior_sigma")
        self.global_ = GlobalModel(version, {k: np.asarray(v, np.float32) for k, v in
                                             initial.items()}, prototypes=prototypes)
        self.spec = {k: v.shape for k, v in self.global_.tensors.items()}
        # the last globals, to rebuild sparse deltas and send delta downlinks (bounded)
        self.history = GlobalHistory(fed.max_staleness + 1)
        self.history.push(version, self.global_.tensors)
        self.active: set[str] = set()
        self.silent: set[str] = set()
        """Clients that left the active set for silence: only a report brings one back."""
        self.roster_complete = fed.mode == "async"
        self.admission = Admission(fed, batch_size)
        self.last_seen: dict[str, float] = {}
        self.tick = 0
        self.rounds = 0
        self.counters: Counter[str] = Counter()
        self.rule_memory: dict = {}  # what the robust rules keep between batches (clipping)
        self._rejoined: set[str] = set()  # clients that rejoined late since their last report
        self.label_owners: dict[str, str] = {}
        """Library labels and the device each is charged to (`label_room`);
        replaced, never changed in place, so that `mark` holds it by reference."""
        self.gate = TaskGate()
        """Async: the last task each client finished (`task_gate.py`)."""
        self._passed: int | None = None
        """`tasks_passed`, kept until a claim or the active set changes (the daemon asks after
        every message)."""
        self._round = _Round()
        self.task_ends = TaskEnds(int(fed.gate_carry_mib * (1 << 20)))
        """Async, task gate: each client's newest update, for the gate's round."""
        self.encoding = get_encoding(fed.encoding)
        self.fold = get_fold(fed.fold)
        self.strategy = self._new_strategy()

    @property
    def carries(self) -> bool:
        """Whether the task gate's round holds end-of-task updates an earlier round counted
        (`task_ends.py`): async with the gate and `gate_carry_mib` on."""
        return (self.fed.mode == "async" and self.fed.task_gate > 0
                and self.fed.gate_carry_mib > 0)

    @property
    def spills(self) -> bool:
        """Whether a full round below `_round_needs` folds what it holds into the strategy
        (`_spill`) instead of growing past `round_max_mib` (`round_spills`)."""
        return round_spills(self.fed, self.global_.prototypes is not None)

    @property
    def keeps_decoded(self) -> bool:
        """Whether an update keeps what validating it decoded until its fold (`Update.checked`,
        counted in the round's bytes): where the round's byte bound holds whatever it holds,
        rounds that spill. Elsewhere (lock-step rounds, rules that hold every update) that
        bound is the start-up check on the wire's bytes (`check_round_memory`), and the fold
        decodes afresh."""
        return self.spills

    def _new_strategy(self) -> Strategy:
        """The run's one strategy (it lives as long as the aggregator)."""
        return self.encoding.strategy(self.fed.aggregation, self.fed, self.spec)

    @property
    def last_seq(self) -> dict[str, int]:
        """The last accepted sequence number of every client."""
        return self.admission.last_seq

    # -- membership -----------------------------------------------------------------------
    def join(self, client: str, now: float | None = None) -> bool:
        """Add a roster client to the active set (it is expected to report); False (and
        counted as `rejected_roster`) for a client the roster does not admit. Only reports
        prove a client alive: joining again leaves an active client's last report time as it
        is, and after it left too (`_rejoin_time`), and a client that left for silence
        (`expire`) comes back only with a report."""
        if not self.admission.admit(client):
            self.counters["rejected_roster"] += 1
            return False
        if client in self.active or client in self.silent:
            return True
        self.active.add(client)
        self._passed = None
        if now is not None:
            self._rejoin_time(client, now)
        if len(self.active) >= min(self.fed.clients, self.admission.cap):
            self.roster_complete = True
        return True

    def _rejoin_time(self, client: str, now: float) -> None:
        """A joining client's last report time: now for a new one; a client that reported
        before keeps its own (leaving and joining again is no report: offline and online
        statuses every few seconds held lock-step to 12 ticks a minute), except once after
        each report when it is older than `client_timeout` (back after a long outage, it is
        waited for as long again)."""
        seen = self.last_seen.get(client)
        if seen is None:
            self.last_seen[client] = now
        elif now - seen > self.fed.client_timeout > 0 and client not in self._rejoined:
            self._rejoined.add(client)
            self.last_seen[client] = now

    def heard_from(self, client: str, now: float | None, rejoin: bool = True) -> None:
        """A report of `client` (taken here, or merged from a shard worker's partial): it is
        alive, its last report time is `now`, and it is active again if it had left for
        silence, or (`rejoin`) at all: a sharded root does not take a device that said it was
        done back into the rounds for an update its worker still held."""
        self._rejoined.discard(client)
        if now is not None:
            self.last_seen[client] = now
        back = client in self.silent
        self.silent.discard(client)
        if client not in self.active and (rejoin or back):
            self.join(client, now)

    def expire(self, now: float) -> RoundClosed | None:
        """Active clients silent for more than `client_timeout` seconds leave the active set;
        may close the pending tick or round."""
        if self.fed.client_timeout <= 0:
            return None
        silent = [c for c in self.active
                  if now - self.last_seen.setdefault(c, now) > self.fed.client_timeout]
        for c in silent:
            self.active.discard(c)
            self.task_ends.drop(c)
            self._passed = None
            self.silent.add(c)
            self.counters["silent_left"] += 1
            log.warning("client %s silent for %.0f s: no longer waited for", c,
                        self.fed.client_timeout)
        return self._maybe_close(now) if silent else None

    def finish_task(self, client: str, task: int, now: float | None = None
                    ) -> RoundClosed | None:
        """An active client's claim that it finished `task` (the task gate, async). When the
        claim opens the gate (every active client finished the task), the open round closes
        if it holds `min_clients` updates: the end-of-task updates not folded yet, which every
        device merges before it evaluates the task, as lock-step does."""
        if client not in self.active:
            return None
        before = self.tasks_passed
        self.gate.finish(client, task)
        self._passed = None
        return self._gate_round(before, now)

    def _gate_round(self, before: int, now: float | None) -> RoundClosed | None:
        """The round a moved gate closes: the open round and the carried end-of-task updates
        (`_carry_task_ends`), with `min_clients` updates and the `quorum` share of the active
        clients, as a timed-out round needs (a device that leaves and comes back to move the
        gate cannot close rounds that a few clients own)."""
        if self.fed.mode != "async" or self.tasks_passed <= before:
            return None
        carried = self._carry_task_ends()
        n = self._round_clients()
        if n < self.fed.min_clients or n < self._quorum():
            self._uncarry(carried)
            return None
        self.counters["closed_gate"] += 1
        self._whole_global = True  # every device evaluates the task on this global
        try:
            closed = self._close_now(now)
        finally:
            self._whole_global = False
        self._uncarry(carried)  # the round did not close
        self.task_ends.forget_tasks(self.tasks_passed)
        return closed

    def _carry_task_ends(self) -> dict[str, Update]:
        """Put into the open round the kept end-of-task updates of the task the gate passed
        whose clients have none in it (an earlier round counted them: `task_ends.py`); none
        into a round that holds nothing new (the current global holds every end-of-task
        model already)."""
        rnd = self._round
        if not self.carries or self.tasks_passed == OPEN or not rnd.clients():
            return {}
        carried = self.task_ends.carry(self.tasks_passed, set(rnd.updates) | set(rnd.spilled),
                                       self.active)
        for c, u in carried.items():
            rnd.updates[c], rnd.carried[c] = u, u.seq
            rnd.nbytes += u.nbytes
        return carried

    def _uncarry(self, carried: dict[str, Update]) -> None:
        """Take carried updates out of a round that did not close."""
        rnd = self._round
        for c, u in carried.items():
            rnd.carried.pop(c, None)
            if rnd.updates.get(c) is u:
                rnd.nbytes -= rnd.updates.pop(c).nbytes

    def _round_clients(self) -> int:
        """Clients in the open round."""
        return len(self._round.updates)

    def _close_now(self, now: float | None) -> RoundClosed | None:
        """Close the open round whatever the timeout (the task gate's round)."""
        return self._close_round(None)

    @property
    def tasks_passed(self) -> int:
        """The highest task every active client has finished (the task gate)."""
        if self._passed is None:
            self._passed = self.gate.passed(self.active)
        return self._passed

    def leave(self, client: str, now: float | None = None) -> RoundClosed | None:
        """Remove a client (stream finished or went offline); may close the pending tick."""
        before = self.tasks_passed
        self.active.discard(client)
        self.task_ends.drop(client)
        self._passed = None
        return self._maybe_close(now) or self._gate_round(before, now)

    # -- input ----------------------------------------------------------------------------
    def validate(self, msg: Update | Tick) -> str | None:
        """The reason to reject `msg`, or None if it is acceptable."""
        reason = self.admission.check(msg, self.global_.version)
        if reason is not None:
            return reason
        if isinstance(msg, Tick):
            return None if self.fed.mode == "sync" else "tick-in-async"
        if msg.encoding != self.encoding.name:
            return "encoding"
        if self.keeps_decoded:
            reason, msg.checked = self.encoding.checked(msg.tensors, self.spec)
        else:  # nothing decoded is kept: no copy made to be dropped
            reason = self.encoding.validate(msg.tensors, self.spec)
        reason = reason or check_variances(msg.tensors)
        if reason is not None:
            return reason
        reason = self._rows.check(msg.prototypes, self.global_.prototypes)
        if reason is not None:
            return reason
        if not eligible(msg.batch, self.fed.burn_in, self.fed.jump):
            return "not-eligible"
        if self.fed.mode == "async" and self.global_.version - msg.base_version > \
                self.fed.max_staleness:
            return "stale"
        return None

    def submit(self, msg: Update | Tick, now: float | None = None) -> RoundClosed | None:
        """Take one report; returns what closed as a consequence, if anything."""
        return None if self.rejects(msg) else self.take(msg, now)

    def rejects(self, msg: Update | Tick) -> bool:
        """Whether `msg` is rejected (`validate`; counted and logged): the checks of one
        report, apart from what taking it sets off (a daemon charges them to its sender)."""
        reason = self.validate(msg)
        if reason is None:
            return False
        self.counters[f"rejected_{reason}"] += 1
        log.warning("rejected %s from %s seq %s: %s", type(msg).__name__.lower(),
                    msg.client, msg.seq, reason, extra={"device": msg.client})
        return True

    def take(self, msg: Update | Tick, now: float | None = None) -> RoundClosed | None:
        """Take a report that `rejects` let through (`submit` without the checks); returns
        what closed as a consequence, if anything."""
        self.admission.accept(msg)
        self.heard_from(msg.client, now)
        rnd = self._round
        if rnd.opened_at is None:
            rnd.opened_at = now
        if self.fed.mode == "sync" and msg.client in rnd.reported:
            self.counters["rejected_early"] += 1
            return None
        rnd.reported.add(msg.client)
        if isinstance(msg, Update):
            self.counters["accepted"] += 1
            if msg.client in rnd.spilled and self._round_full():
                self.counters["dropped_round_full"] += 1  # its older update is in the round
                return self._maybe_close(now)
            if msg.client in rnd.updates:
                self.counters["replaced"] += 1  # one update per client and round: the newest
                rnd.nbytes -= rnd.updates[msg.client].nbytes
            rnd.updates[msg.client] = msg
            rnd.nbytes += msg.nbytes
            if self.carries:
                evicted = self.task_ends.evicted
                self.task_ends.keep(msg, len(self.active))
                if self.task_ends.evicted > evicted:  # over their share: see task_ends.py
                    self.counters["gate_carry_evicted"] += self.task_ends.evicted - evicted
            rnd.arrived += 1
            if self._round_full() and rnd.clients() < self._round_needs(self._quorum()) \
                    and self.spills:
                self._spill()
        else:
            self.counters["ticks"] += 1
        return self._maybe_close(now)

    def lost(self, clients: Iterable[str], now: float | None = None) -> RoundClosed | None:
        """Async: these active clients' updates were shed before they could be read (a full
        inbox). They reported, so the open round stops waiting for them: under overload a round
        that waits for every active client would otherwise wait for the last one to get an
        update through, while the others' newer updates replace theirs."""
        if self.fed.mode != "async":
            return None
        rnd = self._round
        rnd.reported.update(c for c in clients if c in self.active)
        return self._maybe_close(now)

    def _spill(self) -> None:
        """Fold the held updates of clients not folded yet into the strategy now (the robust
        rules over this share, as a shard worker's flush) and free them: a round that
        `min_clients` keeps open holds at most `round_max_mib` of updates."""
        rnd = self._round
        take = sorted(c for c in rnd.updates if c not in rnd.spilled)
        decoded = self.folded(decode_updates(self.encoding, [rnd.updates[c] for c in take],
                                             self.counters))
        for c in take:
            rnd.nbytes -= rnd.updates.pop(c).nbytes
        if not decoded:
            return
        if not rnd.spilled:
            self.strategy.configure_round(RoundInput(self.global_.version,
                                                     self.global_.tensors, self.history.get))
        updates = prepare_round(self.weighed(decoded), self.global_.tensors, self.fed,
                                self.counters, self.encoding.form, self.rule_memory,
                                self.strategy)
        note_round(updates, self.global_.version, self.counters, whole=False)
        for u in updates:
            self.strategy.add(u)
        rnd.spilled.update({u.client: u.seq for u in decoded})
        self.counters["spilled"] += len(decoded)

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
        if rnd.clients() < self.fed.min_clients:
            return None
        if self.active <= rnd.reported:
            return self._close_round(None)
        population = self._population()  # once: a set difference over the round's clients
        quorum = self._quorum(population)
        k = buffer_size(self.fed, population)
        if k and rnd.arrived >= k and rnd.clients() >= min(k, quorum):
            self.counters["closed_buffer"] += 1  # FedBuff: every K updates
            return self._close_round(None)
        if self._round_full() and rnd.clients() >= self._round_needs(quorum):
            self.counters["closed_full"] += 1  # bounded memory: the buffer is full
            return self._close_round(None)
        timed_out = (now is not None and rnd.opened_at is not None
                     and now - rnd.opened_at >= self.fed.round_timeout)
        if timed_out and rnd.clients() >= quorum:
            return self._close_round(None)
        return None

    def _population(self) -> int:
        """The clients a round's quorum and K are shares of: the active ones and those whose
        updates the open round holds (ids that sent and then went offline would otherwise
        count in the round but not in the shares: 50 such ids closed a round of their own
        among 100 honest devices, where 99 that stayed active could not)."""
        rnd = self._round
        return len(self.active) + len((rnd.updates.keys() | rnd.spilled.keys()) - self.active)

    def _round_needs(self, quorum: int) -> int:
        """Clients a full round needs to close rather than spill (`_spill`): `min_clients`,
        and the `quorum` where the rule can spill (colluding ids whose large updates filled
        `round_max_mib` closed rounds of their own: 57 among 1,000 active devices)."""
        return max(self.fed.min_clients, quorum if self.spills else 0)

    def _quorum(self, population: int | None = None) -> int:
        """Clients a round needs before its timeout closes it: `quorum` of `_population`
        (or of `population`, when the caller has it)."""
        size = self._population() if population is None else population
        return math.ceil(self.fed.quorum * size)

    def _round_full(self) -> bool:
        """The open round's updates reach `round_max_mib` (0: no bound)."""
        cap = self.fed.round_max_mib
        return bool(cap) and self._round.nbytes >= cap * (1 << 20)

    def _close_tick(self) -> RoundClosed:
        self.tick += 1
        if len(self._round.updates) >= self.fed.min_clients:
            return self._close_round(self.tick)
        self._round = _Round()
        return RoundClosed(self.tick, None)

    def drop_round(self) -> None:
        """Discard the open round and its updates (counted as `dropped_round`): what the
        daemon does when closing it failed, so that one bad round cannot fail every poll."""
        self.counters["dropped_round"] += 1
        self.counters["dropped_updates"] += len(self._round.updates) + len(self._round.spilled)
        self._round = _Round()

    def _rejects_global(self, g: GlobalModel) -> bool:
        """Whether a round's result `g` would fail the devices' check as they receive it
        (`published_fault`): then it is never a version, the round is dropped (counted,
        logged)."""
        fault = published_fault(g, self.wire_dtype)
        if fault is None:
            return False
        self.counters[f"dropped_global_{fault}"] += 1
        log.warning("round of %d participants dropped: its global would fail the devices' "
                    "check (%s)", len(g.participants), fault)
        return True

    def server_global(self) -> Tensors:
        """The model a round folds into: the published global, or the fuller model sparse
        globals have not published all of (`--global-topk`)."""
        return self.global_.tensors if self._server is None else self._server

    def published(self, result: Tensors) -> tuple[Tensors, Tensors | None]:
        """A round's result as the global it publishes, and the model the next round folds
        into (None: the published one): with `--global-topk`, only the largest changes are
        published (`sparse_global.sparse_step`), except in the task gate's round, which
        publishes everything held back."""
        if self.fed.global_topk <= 0 or self._whole_global:
            return result, None
        out = sparse_step(self.global_.tensors, result, self.fed.global_topk)
        held_back = any(out[k] is not t for k, t in result.items())
        return out, result if held_back else None

    def mark(self) -> tuple:
        """What `restore` goes back to: the global, the round count, the label owners, the
        model sparse globals fold into, the robust rules' memory and what the strategy
        keeps between rounds."""
        return (self.global_, self.rounds, self.label_owners, self._server,
                copy_memory(self.rule_memory), self.strategy.kept())

    def restore(self, mark: tuple) -> None:
        """Go back to `mark`: the rounds since made globals that were never saved nor
        announced (the daemon failed to), so they never happened."""
        previous, self.rounds, self.label_owners, self._server, self.rule_memory, kept = mark
        self.strategy.load_kept(kept)
        self.history.drop_after(previous.version)
        self.global_ = previous

    def _close_round(self, tick: int | None) -> RoundClosed | None:
        """Aggregate the round (None: an async round that, without the updates dropped while
        decoding, has fewer than `min_clients` and waits for more)."""
        rnd = self._round
        later = {c: u for c, u in rnd.updates.items() if c in rnd.spilled}
        decoded = self.folded(decode_updates(
            self.encoding, [rnd.updates[c] for c in sorted(rnd.updates) if c not in later],
            self.counters))
        if len(decoded) + len(rnd.spilled) < max(self.fed.min_clients, 1):
            if tick is None and (decoded or rnd.spilled):
                kept = {u.client for u in decoded} | set(later)
                for c in [c for c in rnd.updates if c not in kept]:
                    rnd.nbytes -= rnd.updates.pop(c).nbytes
                return None
            self._round = _Round()
            return RoundClosed(tick, None)
        seqs = dict(sorted((rnd.spilled | {u.client: u.seq for u in decoded
                                           if u.client not in rnd.carried}).items()))
        carried = {u.client: u.seq for u in decoded if u.client in rnd.carried}
        participants = tuple(sorted(seqs | carried))
        if not rnd.spilled:
            self.strategy.configure_round(RoundInput(self.global_.version,
                                                     self.global_.tensors, self.history.get,
                                                     participants))
        updates = prepare_round(self.weighed(decoded), self.global_.tensors, self.fed,
                                self.counters, self.encoding.form, self.rule_memory,
                                self.strategy)
        note_round(updates, self.global_.version, self.counters, whole=not rnd.spilled)
        if rnd.spilled:
            self.counters[f"round_size_{len(participants)}"] += 1
        for u in updates:
            self.strategy.add(u)
        kept = self.strategy.kept()
        tensors, server = self.published(self.strategy.result(self.server_global()))
        self.counters.update(self.strategy.counters())
        library, owners = self._next_prototypes(updates)
        candidate = GlobalModel(self.global_.version + 1, tensors, participants, library,
                                counted=dict(sorted((seqs | carried).items())))
        if self._rejects_global(candidate):
            self.strategy.load_kept(kept)  # the round never happened
            self._round = _Round()
            return RoundClosed(tick, None)
        self.global_, self.label_owners, self._server = candidate, owners, server
        self.history.push(self.global_.version, tensors)
        self.rounds += 1
        self.counters["carried"] += len(carried)
        self._round = _Round(later, arrived=len(later),
                             nbytes=sum(u.nbytes for u in later.values()))
        log.info("round %d closed: version %d, participants %s", self.rounds,
                 self.global_.version, ",".join(participants))
        return RoundClosed(tick, self.global_, participants, seqs, carried)

    def folded(self, decoded: list[Update]) -> list[Update]:
        """The round's decoded updates as the fold rule (`fed.fold`) has them averaged (an
        update it drops takes no part in the round)."""
        if self.encoding.form != "dense":
            return decoded  # other forms carry their own base (folds.py)
        return self.fold.apply(decoded, self.server_global(), self.global_.version,
                               self.history.get, self.counters)

    def weighed(self, updates: list[Update]) -> list[Update]:
        """The round's folded updates with their staleness and task-lag weights
        (`round_weights.py`), for the robust rules; after `strategy.configure_round`."""
        return weigh(updates, self.global_.version, self.fed, self.strategy)

    # -- library of label rows (a library head's rule: federation/heads.py) ---------------
    def _rows_by_likelihood(self, table: LabelRows | None) -> bool:
        """Whether Gaussian rows follow the fedbnn rule (likelihoods times the prior)."""
        return table is not None and table.gaussian and get_rule(self.fed).multiplies_likelihoods

    def _next_prototypes(self, updates: list[Update]
                         ) -> tuple[LabelRows | None, dict[str, str]]:
        """The round's library and label owners (the head's rule, `heads.RowsRule.fold`)."""
        previous = self.global_.prototypes
        if previous is None:
            return None, self.label_owners
        return self._rows.fold(updates, previous, self.label_owners, self.fed,
                               self.admission.cap, self.counters,
                               self._rows_by_likelihood(previous), self.row_prior_sigma,
                               self.strategy.row_combiner())

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> dict:
        """What the daemon saves after every round (enough to resume)."""
        return {"version": self.global_.version, "tensors": self.global_.tensors,
                "participants": list(self.global_.participants), "tick": self.tick,
                "rounds": self.rounds, "last_seq": dict(self.last_seq),
                "admission": self.admission.state(), "counters": dict(self.counters),
                "label_owners": dict(self.label_owners), "tasks_finished": self.gate.state(),
                "rule_memory": {k: list(v) for k, v in self.rule_memory.items()},
                "strategy": self.strategy.kept()}

    def load_state(self, state: dict) -> None:
        """Resume from `state()` output, with the global's prototype library under
        "prototypes" (saved by the daemon next to the tensors; absent: the current one)."""
        self.global_ = GlobalModel(int(state["version"]), dict(state["tensors"]),
                                   tuple(state.get("participants", ())),
                                   state.get("prototypes", self.global_.prototypes))
        self.history.clear()
        self.history.push(self.global_.version, self.global_.tensors)
        self.tick = int(state.get("tick", 0))
        self.rounds = int(state.get("rounds", 0))
        self.admission.load_state(state.get("admission", {"last_seq": state.get("last_seq", {})}))
        self.counters = Counter(state.get("counters", {}))
        self.label_owners = {str(k): str(v) for k, v in state.get("label_owners", {}).items()}
        self.rule_memory = load_memory(state.get("rule_memory", {}))
        self.gate.load_state(state.get("tasks_finished", {}))
        kept = state.get("strategy", {})
        self.strategy.load_kept(kept if isinstance(kept, dict) else {})
        self._passed = None
