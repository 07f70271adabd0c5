"""A bounded, fair inbox between the MQTT network thread and a daemon's main loop.

The network thread must never block and the daemon must never hold more than it can handle:
the inbox is bounded by the bytes it holds (and a message count), and a message that does not
fit is shed and counted instead of queued.

It is fair per sender (the device a topic belongs to, `sender_of`): each sender has its own
queue of at most `per_sender` messages (and a quarter of the byte budget, one message always
fits) and, with `rate`, a token bucket of messages a second, and `get` serves the senders
round-robin. A device that floods gets one turn in each round like any other and its backlog
stays bounded: a message beyond its queue sheds the sender's oldest waiting one (its newest
matter: an update supersedes the one before, and a device's backlog after an outage ends with
what it sent last), counted as `over_share` per sender (`offenders`): one device cannot take
the inbox, the main loop's time or the honest devices' place in line. `load()` reports what
the inbox saw since its last call (offered, shed, taken, mean fill, the main loop's idle
share) for backpressure, leaving
out the messages shed over a sender's share: one sender's flood is not the fleet's load.
Under backpressure the daemon's update quota names the devices sending over their fair share
(`over_limit`): when the inbox is full, a message of such a device is refused and one of
theirs makes room for anyone else's, both counted over their share, not as shed (with half of
1,000 devices ignoring the factor over the broker, their messages filled the inbox, the
compliant devices' were shed, and the factor locked at its cap: 6x the folds for ignoring).
Those refusals are handed back to the quota (`take_refused`): they are part of what the device
sends, and a device measured by what got past the inbox looked within its limit every other
interval (1.77x the folds of a compliant device with 20 % ignoring).
With `cpu_share`, each sender also has a budget of the main loop's time: the daemon handles
(decodes and checks) each message inside `charging`, which counts the thread's CPU time against
its sender, and `get` passes over a sender that has spent its share while a sender within its
own waits (`over_cpu` counts the senders passed over; its queue's bounds shed the rest):
messages that each cost the scan of a made-up payload, or the digest of a large valid one, no
longer buy one device more of a busy loop than its share, and an idle loop's time is no
one's (refused at `put`, the updates of honest devices of a 45 MB model that came together
were dropped: 28 of 60 at one a second each, on a loop busy 0.6 s of each second).
The senders of reports it refused (`is_report`: updates) are handed to the aggregator
(`take_lost`), whose open round then stops waiting for them. With `supersede` (async), a
sender's newer report replaces its report still waiting: under overload a queue of small
updates held several of each device's, whose newer ones then replaced the older in the round.
The newer report counts as offered load (it was read).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from itertools import islice
from typing import Any

from edgefcl.runtime.backpressure import Load
from edgefcl.transport.topics import Topics

PER_SENDER = 8
"""Messages one sender may have waiting (an honest device has one or two: an update, a status)."""
INVALID_SENDER = "<topic too long>"
"""The one sender of every topic longer than any of the fleet's: made-up topics that each
were their own queue, offender and log key, however long."""
MAX_OFFENDERS = 1024
"""Senders whose over-share sheds are counted (the largest counts are kept)."""
MAX_LOST = 65_536
"""Senders whose lost reports are remembered between two `take_lost` calls (the roster's
devices fit; a flood of made-up ids cannot grow it further)."""
CPU_BURST_S = 2.0
"""Seconds of its CPU share a sender may spend at once (as its message rate's 2 s burst)."""
MAX_SCAN = 1024
"""Senders in line `get` looks at for one with CPU time left (the scan stays bounded: about
0.4 ms when every one is over its share, which takes each of them that much handling time)."""
MAX_EVICTIONS = 4
"""Messages of senders over their limit a full inbox sheds to queue one of another sender."""


SUPERSEDED_LOAD = 4
"""A sender's superseded reports counted as offered load in one status interval (`load`)."""


class Inbox:
    """Per-sender FIFOs served round-robin, with a byte budget; `put` never blocks, `get`
    waits."""

    def __init__(self, max_bytes: int, max_items: int = 10_000,
                 sender_of: Callable[[str], str] | None = None,
                 per_sender: int = PER_SENDER, rate: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 over_limit: Callable[[], AbstractSet[str]] | None = None,
                 is_report: Callable[[str], bool] | None = None,
                 supersede: bool = False, cpu_share: float = 0.0,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock  # a virtual one in the backpressure bench
        self.is_report = is_report  # topics whose messages a round waits for (updates)
        self.supersede = supersede and is_report is not None  # a newer report replaces one
        # of the same sender still waiting (async: a device's newest model is what counts)
        self.superseded = 0
        self._superseded_taken = 0
        self._superseded_load = 0  # of `superseded`, those counted as load (SUPERSEDED_LOAD)
        self._superseding: Counter[str] = Counter()  # per sender, since the last `load`
        self._lost: set[str] = set()  # senders of such messages refused since `take_lost`
        self.over_limit = over_limit  # senders over their fair share (see the docstring)
        self.refused: Counter[str] = Counter()  # their messages refused or shed since
        # `take_refused`
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.sender_of = sender_of or (lambda topic: topic)
        self.per_sender = per_sender
        self.rate = rate  # messages a second per sender, a burst of 2 s (0: no limit)
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, at)
        self.cpu_share = cpu_share  # seconds of the main loop a second per sender (0: none)
        self.cpu_clock = cpu_clock  # the handling thread's CPU seconds
        self._cpu: dict[str, tuple[float, float]] = {}  # sender -> (seconds left, at)
        self._uncharged = 0.0  # seconds of the message being charged left out of it
        self._cpu_pruned = float("-inf")  # when `_cpu` was last scanned for full budgets
        self.over_cpu = 0
        self._deferred: set[str] = set()  # senders passed over and not served since
        self._queues: dict[str, deque[tuple[str, Any, int]]] = {}
        self._held: Counter[str] = Counter()  # bytes each sender has waiting
        self._turns: deque[str] = deque()  # senders with something waiting, in service order
        self._count = 0
        self._cond = threading.Condition()
        self.bytes = 0
        self.shed = 0
        self.shed_bytes = 0
        self.over_share = 0
        self.offenders: Counter[str] = Counter()
        self.queued = 0
        self.taken = 0
        self._since = self.clock()  # the interval load() reports on
        self._t = self._since  # last change of `bytes`
        self._area = 0.0  # integral of bytes over time since `_since`
        self._waited = 0.0  # seconds the main loop waited for input since `_since`
        self._mark = (0, 0, 0, 0)  # queued, shed, taken, superseded at `_since`

    def _account(self) -> None:
        """Add the time since the last change of `bytes` to the fill integral (under lock)."""
        now = self.clock()
        self._area += self.bytes * (now - self._t)
        self._t = now

    def put(self, topic: str, item: Any) -> bool:
        """Queue `item` unless its sender's queue or the inbox is full; returns whether it
        was queued."""
        size = len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0
        sender = self.sender_of(topic)
        with self._cond:
            if not self._within_rate(sender):
                self.over_share += 1
                self._offend(sender)
                self._note_lost(topic, sender)
                return False
            mine = self._queues.get(sender)
            if mine and self.supersede and self.is_report(topic) and self._supersede(
                    sender, mine, topic, item, size):
                return True
            while mine and (len(mine) >= self.per_sender
                            or self._held[sender] + size > self.max_bytes // 4):
                self._drop_oldest(sender, mine)  # its newest messages matter: keep them
            if not self._room(sender, size):
                self._note_lost(topic, sender)
                return False
            mine = self._queues.get(sender)
            self._account()
            if mine is None:
                mine = self._queues[sender] = deque()
                self._turns.append(sender)
            mine.append((topic, item, size))
            self._held[sender] += size
            self._count += 1
            self.queued += 1
            self.bytes += size
            self._cond.notify()
            return True

    def _full(self, size: int) -> bool:
        return self.bytes + size > self.max_bytes or self._count >= self.max_items

    def _room(self, sender: str, size: int) -> bool:
        """Whether a message of `sender` fits now (under the lock): a full inbox refuses it,
        counted over the sender's share when it is over its limit and as shed otherwise,
        after shedding up to MAX_EVICTIONS waiting messages of senders over their limit."""
        if not self._full(size):
            return True
        over = self.over_limit() if self.over_limit is not None else ()
        if sender in over:
            self.over_share += 1
            self._offend(sender)
            self._note_refused(sender)
            return False
        if over:  # the oldest turns first; nobody over the limit: no scan at all
            victims = list(islice((s for s in self._turns if s in over), MAX_EVICTIONS))
            for victim in victims:
                self._drop_oldest(victim, self._queues[victim])
                self._note_refused(victim)
                if not self._full(size):
                    return True
        self.shed += 1
        self.shed_bytes += size
        return False

    def _note_refused(self, sender: str) -> None:
        self.refused[sender] += 1
        if len(self.refused) > MAX_OFFENDERS:  # bounded: keep the largest half
            self.refused = Counter(dict(self.refused.most_common(MAX_OFFENDERS // 2)))

    def take_refused(self) -> Counter[str]:
        """Messages of senders over their limit refused or shed since the last call, per
        sender (the quota counts them in the senders' rates)."""
        with self._cond:
            out, self.refused = self.refused, Counter()
            return out

    def _note_lost(self, topic: str, sender: str) -> None:
        if (self.is_report is not None and len(self._lost) < MAX_LOST
                and self.is_report(topic)):
            self._lost.add(sender)

    def take_superseded(self) -> int:
        """Reports superseded unread (`supersede`) since the last call."""
        with self._cond:
            out, self._superseded_taken = self.superseded - self._superseded_taken, self.superseded
            return out

    def take_lost(self) -> set[str]:
        """Senders of reports (`is_report` topics) refused since the last call: the open round
        need not wait for them (`Aggregator.lost`)."""
        with self._cond:
            out, self._lost = self._lost, set()
            return out

    def _supersede(self, sender: str, mine: deque[tuple[str, Any, int]], topic: str,
                   item: Any, size: int) -> bool:
        """Put a report of `sender` in the place of its report still waiting, if it has one
        and the difference fits (under the lock): the sender keeps its turn (sent to the back,
        a device that sends faster than it is served would never be served). The newer one
        counts as offered (`load`): the network thread read it, and devices that send faster
        than the daemon folds make it read updates it then drops (1,000 sparse devices at
        2x: left out of the load, the factor stayed near 1.4 and the daemon, reading 1.5x
        what it folded, folded 0.75 of its capacity). The main loop takes nothing while it
        closes a round, so such an interval alone reads as an overload; the controller
        rises only on two in a row (`runtime/backpressure.py`). At most SUPERSEDED_LOAD of a
        sender's an interval count: beyond, a device sends faster than any factor slows it,
        and counted whole, five such devices at their message rate raised the factor an
        honest fleet follows (it then folded 0.73 of the capacity, in a model of the loop)."""
        at = next((i for i, m in enumerate(mine) if self.is_report(m[0])), None)
        if at is None:
            return False
        delta = size - mine[at][2]
        if delta > 0 and self.bytes + delta > self.max_bytes:
            return False
        self._account()
        mine[at] = (topic, item, size)
        self._held[sender] += delta
        self.bytes += delta
        self.superseded += 1
        if self._superseding[sender] < SUPERSEDED_LOAD:
            self._superseding[sender] += 1
            self._superseded_load += 1
        return True

    def _drop_oldest(self, sender: str, mine: deque[tuple[str, Any, int]]) -> None:
        """Shed `sender`'s oldest waiting message (over its share; under the lock)."""
        _, _, size = mine.popleft()
        self._account()
        self._held[sender] -= size
        self._count -= 1
        self.bytes -= size
        self.queued -= 1  # never offered to the main loop: not load
        self.over_share += 1
        self._offend(sender)
        if not mine:  # `put` appends the new message at once
            del self._queues[sender], self._held[sender]
            self._turns.remove(sender)
            self._deferred.discard(sender)

    @contextmanager
    def charging(self, sender: str | None) -> Iterator[None]:
        """Count the calling thread's CPU time in the block (handling a message of `sender`)
        against the sender's share (`cpu_share`), also when the block raises, less the time
        in its `uncharged` blocks (`sender` None: no one's)."""
        if self.cpu_share <= 0 or sender is None:
            yield
            return
        t0, self._uncharged = self.cpu_clock(), 0.0
        try:
            yield
        finally:
            spent = self.cpu_clock() - t0 - self._uncharged
            with self._cond:
                now = self.clock()
                self._cpu[sender] = (self._cpu_left(sender, now) - spent, now)
                if len(self._cpu) > MAX_OFFENDERS and now - self._cpu_pruned >= 1.0:
                    # bounded: senders with a full budget go (a scan at most once a second)
                    full, self._cpu_pruned = CPU_BURST_S * self.cpu_share, now
                    self._cpu = {k: v for k, v in self._cpu.items()
                                 if self._cpu_left(k, now) < full}

    @contextmanager
    def uncharged(self) -> Iterator[None]:
        """Leave the block's CPU time out of the message being charged (`charging`): the
        fleet's work that a message sets off, such as submitting an update or closing a
        round, is no one device's."""
        t0 = self.cpu_clock()
        try:
            yield
        finally:
            self._uncharged += self.cpu_clock() - t0

    def _cpu_left(self, sender: str, now: float) -> float:
        """`sender`'s CPU seconds left (refilled at `cpu_share` a second, at most
        CPU_BURST_S of it; below 0 after a message that cost more than was left)."""
        full = CPU_BURST_S * self.cpu_share
        left, at = self._cpu.get(sender, (full, now))
        return min(full, left + (now - at) * self.cpu_share)

    def _within_rate(self, sender: str) -> bool:
        """Take a token of `sender`'s bucket (refilled at `rate` a second, holding 2 s of
        them); False when it has none. The buckets of idle senders are dropped past
        MAX_OFFENDERS senders, so the table stays bounded."""
        if self.rate <= 0:
            return True
        now = self.clock()
        burst = 2 * self.rate
        tokens, at = self._buckets.get(sender, (burst, now))
        tokens = min(burst, tokens + (now - at) * self.rate)
        if len(self._buckets) > MAX_OFFENDERS:
            self._buckets = {k: v for k, v in self._buckets.items()
                             if v[0] + (now - v[1]) * self.rate < burst}
        if tokens < 1:
            self._buckets[sender] = (tokens, now)
            return False
        self._buckets[sender] = (tokens - 1, now)
        return True

    def _offend(self, sender: str) -> None:
        self.offenders[sender] += 1
        if len(self.offenders) > MAX_OFFENDERS:  # bounded: keep the worst half
            self.offenders = Counter(dict(self.offenders.most_common(MAX_OFFENDERS // 2)))

    def get(self, timeout: float) -> tuple[str, Any] | None:
        """The oldest item of the sender whose turn it is (`_next_turn`), or None after
        `timeout` seconds without one."""
        with self._cond:
            if not self._count:
                t0 = self.clock()
                ready = self._cond.wait_for(lambda: self._count, timeout)
                self._waited += self.clock() - t0
                if not ready:
                    return None
            sender = self._next_turn()
            mine = self._queues[sender]
            topic, item, size = mine.popleft()
            if mine:
                self._turns.append(sender)
            else:
                del self._queues[sender], self._held[sender]
            if sender in self._held:
                self._held[sender] -= size
            self._account()
            self._count -= 1
            self.taken += 1
            self.bytes -= size
            return topic, item

    def _next_turn(self) -> str:
        """The first sender in line with CPU time left (`cpu_share`; the senders passed over
        keep their places, each counted once in `over_cpu` until it is served), or the first
        in line when none of the first MAX_SCAN has any (under the lock; a sender waits)."""
        if self.cpu_share > 0:
            now = self.clock()
            for i, sender in enumerate(islice(self._turns, MAX_SCAN)):
                if self._cpu_left(sender, now) > 0:
                    passed = set(islice(self._turns, i)) - self._deferred
                    self._deferred |= passed
                    self.over_cpu += len(passed)
                    del self._turns[i]
                    self._deferred.discard(sender)
                    return sender
        sender = self._turns.popleft()
        self._deferred.discard(sender)
        return sender

    def waited(self, seconds: float) -> None:
        """Count `seconds` the main loop waited for input (`get` counts its own waits; the
        backpressure bench's virtual main loop tells its idle time here)."""
        with self._cond:
            self._waited += seconds

    def load(self) -> Load:
        """Messages offered, shed and taken, the mean fill of the byte budget and the share of
        the time the main loop waited for input since the last call (the first call: since the
        inbox was made); sheds over a sender's share are left out, superseding reports count
        as offered."""
        with self._cond:
            self._account()
            span = self._t - self._since
            q, s, t, r = self._mark
            fill = self._area / span / self.max_bytes if span > 0 and self.max_bytes else 0.0
            idle = min(self._waited / span, 1.0) if span > 0 else 0.0
            load = Load(offered=self.queued - q + self.shed - s + self._superseded_load - r,
                        shed=self.shed - s, taken=self.taken - t, fill=fill, idle=idle)
            self._since, self._area, self._waited = self._t, 0.0, 0.0
            self._mark = (self.queued, self.shed, self.taken, self._superseded_load)
            self._superseding.clear()
            return load

    def worst(self, n: int = 5) -> dict[str, int]:
        """The `n` senders with the most messages shed over their share."""
        with self._cond:
            return dict(self.offenders.most_common(n))

    def __len__(self) -> int:
        with self._cond:
            return self._count


def sender_of(topics: Topics) -> Callable[[str], str]:
    """The inbox's sender key of a fleet's topic: the client id of a device's topic, else the
    topic itself (control, partials: one queue each), or INVALID_SENDER for one longer than
    any of the fleet's."""
    def key(topic: str) -> str:
        try:
            return topics.client_from(topic)
        except ValueError:
            return topic if len(topic) <= topics.longest else INVALID_SENDER

    return key


def shed_counters(inbox: Inbox) -> dict[str, Any]:
    """What a daemon's status says of its inbox's sheds: counters, and the senders with the
    most messages shed over their share (who is flooding). (Superseded reports go into the
    aggregator's own counters, which state.json keeps: `take_superseded`.)"""
    out: dict[str, Any] = {}
    if inbox.shed:
        out["rejected_inbox_full"] = inbox.shed
    if inbox.over_share:
        out["rejected_over_share"] = inbox.over_share
    if inbox.over_cpu:
        out["deferred_over_cpu"] = inbox.over_cpu  # senders passed over: over their CPU share
    return out
