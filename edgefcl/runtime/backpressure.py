"""Backpressure: an aggregator that receives more than it folds asks its devices to send less.

Aggregator side (`Backpressure`): every status interval the daemon hands over what its inbox
saw in that interval (`Load`): messages offered by the network thread (queued + shed), messages
shed, messages the main loop took out, and the mean inbox fill. The factor (>= 1, at most
`fed.max_backpressure`) is published on the retained config and status with its reason:

- shed > 0 ("shed"): factor x max(offered / taken, offered / queued), the rise that would
  have let everything offered be queued (a few messages shed in a burst raise it a little,
  an overload by its size);
- mean fill >= HIGH_FILL while arrivals keep up with the folds (offered >= taken; "fill"):
  factor x max(offered / taken, STEP); an inbox that drains is recovering from a burst (at 1x
  over the broker, raising the factor then cost 0.09 of the capacity);
- offered / taken > 1 + SLACK in two measured intervals in a row ("behind": arrivals outrun
  the folds): factor x offered / taken over both; after one such interval the factor holds.
  The main loop takes nothing while it closes a round, so an interval that ends in a round's
  close reads as behind and the next one drains it: rising on each such interval ratcheted the
  factor up (1,000 sparse devices at 2x over the broker: rounds of 1,000, the factor up to
  7.7, 0.48 of the capacity folded). A loop that idled more than 1 - BUSY of the interval was
  not behind: the idle rule below applies instead of the hold or the rise (after the start-up
  burst of rounds of 1,000, holding there delayed the descent by an interval), and the
  interval still counts as the first of two;
- otherwise factor x DECAY, towards 1: the aggregator keeps probing for more load, so under
  a steady overload the factor settles where it folds at its capacity with little shed (a band
  that held the factor would leave it wherever a burst had pushed it); and lower when the main
  loop idled (`Load.idle`): at factor f a loop busy a share b of the interval would have kept
  up with about f x b, so the factor goes to f x b / BUSY at once (a load that drops, or a
  rise that overshot, is followed within one interval rather than by x DECAY per interval).

Whatever the rule, the factor rises at least as far as the update quota asks (`rise`,
"share"): when nearly every device sends over its fair share, the quota would hold compliant
devices to it with the others, and its refusals are not load (`UpdateQuota.rise`).

The interval after a rise is not measured (the factor holds): devices react within one update
period, so that interval's arrivals still mix the old and the new rate, and measuring them would
raise the factor twice for one overload.

Sharded aggregation: each worker runs its own `Backpressure` on its inbox (the devices'
updates reach the workers) and puts the factor on its status; the root advertises the highest
factor of its live workers (`relay`) as soon as a worker status changes it.

Device side (`Pacer`): with factor f a device sends one of every f updates its burn-in / jump
schedule makes due (a credit of 1 / f per due update, starting at a level drawn from the
device's id; fractional factors average out), i.e. its jump becomes jump x f. A held update
consumes its sequence number (the aggregator's admission bounds the mini-batch by the sequence
number) and is never encoded, so error feedback and the async delta rule see only what was
sent; the next update carries the progress. An update it sends goes out after a delay drawn
uniformly over the time between its due updates (`delay`): devices due at the same instants
would otherwise send in one burst however their credits differ.
Lock-step mode never uses it.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from edgefcl.config import FedConfig

HIGH_FILL = 0.5
SLACK = 0.1
STEP = 1.1
DECAY = 0.9
BUSY = 0.9
"""The main loop's busy share the factor comes down to at once when the loop idles more."""
REASONS = ("shed", "fill", "behind", "share")
SPREAD_FLEET = 100
"""Active (or expected: `fed.clients`) devices from which an aggregator asks its fleet to
spread its sends at once (a smaller fleet is asked after its inbox first sheds)."""
MAX_DELAY_S = 10.0
"""The longest send delay of a device (`Pacer.delay`)."""
PAUSE_PERIODS = 2.0
"""A gap between due updates longer than this many periods, after one that was not, is a pause,
and counts as this many in the measured period (`Pacer.take`): devices due every 0.5 s in
bursts 30 s apart measured 9.35 s after each quiet spell, and delayed their sends over the
whole 10 s burst. A second long gap in a row counts whole: the device slowed down (capped each
time, the period grew 1.3x an update after a fleet's load dropped to a tenth, the delays
covered a part of the new period, and the inbox shed)."""


@dataclass(frozen=True)
class Load:
    """What the inbox saw in one status interval."""

    offered: int
    """Messages the network thread handed to the inbox (queued or shed)."""
    shed: int
    taken: int
    """Messages the main loop took out (and handled)."""
    fill: float
    """Mean fill of the inbox's byte budget (0..1) over the interval."""
    idle: float = 0.0
    """Share of the interval (0..1) the main loop waited for input with nothing to do."""

    def less(self, refused: int) -> Load:
        """This load without `refused` messages that were taken but refused at once (the
        update quota's: devices over their fair share send them whatever the factor); at
        least 0 offered (messages the inbox held from the interval before are taken and
        refused in this one)."""
        n = min(refused, self.taken)
        return Load(max(self.offered - n, 0), self.shed, self.taken - n, self.fill, self.idle)


class Backpressure:
    """The factor an aggregator advertises, updated once per status interval."""

    @classmethod
    def for_fed(cls, fed: FedConfig) -> Backpressure:
        """Bounded by `fed.max_backpressure` in async mode; off (1) in lock-step mode. A
        fleet expected to hold SPREAD_FLEET devices or more (`fed.clients`) is asked to spread
        its sends from the start: devices started together would otherwise send their first
        updates in one burst, before the daemon has seen them (1,000 synchronised devices
        over the broker: the burst shed 734, the factor rose to 3.8 and the tier folded 0.67
        of its capacity at 2x)."""
        bp = cls(fed.max_backpressure if fed.mode == "async" else 1.0)
        bp.spread_for(fed.clients)
        return bp

    def __init__(self, max_factor: float) -> None:
        self.max_factor = max(1.0, float(max_factor))
        self.factor = 1.0
        self.reason = ""
        self.spread = False
        """Whether devices are asked to spread their sends (`Pacer.delay`): once the fleet
        has SPREAD_FLEET active devices or the inbox has shed (it stays on)."""
        self._settling = False
        self._behind: Load | None = None  # the last measured interval, when it was behind
        self.busy: float | None = None
        """The share of the last interval the main loop was busy (None before the first)."""

    @property
    def enabled(self) -> bool:
        return self.max_factor > 1.0

    def update(self, load: Load, rise: float = 1.0) -> float:
        """The new factor after an interval with `load` (also sets `reason` and `busy`), at
        least `rise` times the factor before (the update quota's ask: "share")."""
        self.busy = round(1.0 - load.idle, 2)
        if not self.enabled:
            return self.factor
        ratio = load.offered / max(load.taken, 1)
        behind = ratio > 1 + SLACK  # arrivals outran the folds
        self.spread = self.spread or load.shed > 0
        prev = self.factor
        if self._settling:
            self._settling = False
            return prev
        before, self._behind = self._behind, None
        if load.shed > 0:
            queued = max(load.offered - load.shed, 1)
            new, why = prev * max(ratio, load.offered / queued), "shed"
        elif load.fill >= HIGH_FILL and ratio >= 1.0:
            new, why = prev * max(ratio, STEP), "fill"
        elif behind and 1.0 - load.idle >= BUSY:  # a loop that idled was not behind
            if before is None:  # behind once: a round's close, or more?
                self._behind = load
                new, why = prev, self.reason
            else:
                both = (load.offered + before.offered) / max(load.taken + before.taken, 1)
                new, why = prev * both, "behind"
        else:  # nothing queues, so offered = taken hides the spare capacity: the idle
            # share shows it (a factor f leaving the loop busy b is about f x b too high)
            if behind:  # but the loop idled: remembered as the first of two, not held
                self._behind = load
            new, why = prev * min(DECAY, (1.0 - load.idle) / BUSY), self.reason
        if rise > 1.0 and new < prev * rise and 1.0 - load.idle >= BUSY:  # (an idle loop
            # has room: the rates the quota judges lag a load that dropped)
            new, why = prev * rise, "share"
        self.factor = round(min(max(new, 1.0), self.max_factor), 2)
        self._settling = self.factor > prev
        self.reason = why if self.factor > 1.0 else ""
        return self.factor

    def observe(self, load: Load, seconds: float, rise: float = 1.0) -> str | None:
        """`update` with an interval's load and the quota's `rise`; a log line when the
        factor changed, else None."""
        before = self.factor
        if self.update(load, rise) == before:  # off: it only notes the busy share
            return None
        why = self.reason if self.factor > before else "down"
        return (f"backpressure {self.factor:.2f} ({why}; last {seconds:g} s: offered "
                f"{load.offered}, shed {load.shed}, taken {load.taken}, fill {load.fill:.2f}, "
                f"idle {load.idle:.2f})")

    def relay(self, pressure: dict[str, tuple[float, str]]) -> float:
        """Advertise the highest factor of `pressure` (a sharded root: (factor, reason) by
        worker id); the fleet sends no faster than its most loaded worker folds."""
        if not self.enabled:
            return self.factor
        top = max(pressure, key=lambda w: pressure[w][0], default=None)
        factor, why = pressure.get(top, (1.0, ""))
        self.factor = min(max(factor, 1.0), self.max_factor)
        self.reason = f"{top}: {why}" if self.factor > 1.0 else ""
        return self.factor

    def fields(self) -> dict[str, float | str | bool]:
        """What the config and status carry (nothing when backpressure is off; the daemon's
        status also carries `busy`)."""
        if not self.enabled:
            return {}
        return {"backpressure": self.factor, "backpressure_reason": self.reason,
                "spread_sends": self.spread}

    def spread_for(self, active: int) -> bool:
        """Turn `spread` on for a fleet of `active` devices; True when that changed it."""
        if self.spread or not self.enabled or active < SPREAD_FLEET:
            return False
        self.spread = True
        return True


def spread_advertised(body: dict | None) -> bool:
    """Whether a config or status body asks devices to spread their sends (a bool only)."""
    return (body or {}).get("spread_sends") is True


def advertised(body: dict | None, max_factor: float) -> float:
    """The factor a config or status body advertises, within [1, max_factor] (1 when absent or
    malformed: a device is never silenced by a message it cannot read)."""
    value = (body or {}).get("backpressure", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 1.0
    return min(max(float(value), 1.0), max(1.0, max_factor))


class Pacer:
    """Which due updates a device sends under backpressure: one in `factor`.

    The credit starts at a level drawn from the device's id and seed (uniform in [0, 1)):
    devices that pace alike still send in different slots of every `factor` due updates, so a
    fleet told to slow down spreads its sends instead of sending in the same bursts (with a
    credit from 0 every device sent on the same due update, the inbox shed each burst and the
    factor locked at its cap). DeviceRunner, firmware_sim and the load generator all pace
    with it."""

    def __init__(self, device: str = "", seed: int = 0) -> None:
        self.factor = 1.0
        digest = hashlib.sha256(f"{seed}:{device}".encode()).digest()
        self.credit = int.from_bytes(digest[:8], "big") / 2**64
        self.phase = random.Random(digest[8:]).random()
        """Where in the period this device sends when it spreads its sends (`delay`)."""
        self.held = 0
        self.period = 0.0
        """Seconds between due updates (smoothed), when `take` is given the time."""
        self.spreading = False
        """Whether sends are delayed (`delay`): as the aggregator advertises
        (`spread_sends`)."""
        self._due_at: float | None = None
        self._long = False  # whether the last gap was over PAUSE_PERIODS periods

    def delay(self, period: float | None = None) -> float:
        """Seconds to wait before sending an update taken now: 0 unless the aggregator asks
        its fleet to spread its sends (`spreading`), then the device's own `phase` (drawn once
        from its id and seed, uniform in [0, 1)) times the period (default: the measured time
        between due updates, at most MAX_DELAY_S), so that devices whose updates fall due at
        the same instants (streams replayed in step, a fleet started at once) reach the
        aggregator spread over the period instead of in one burst that the inbox sheds (in the
        backpressure bench: 0.09 of capacity folded at 1x with synchronised devices, 0.99 with
        the delay). A fixed phase keeps each device's sends one period apart: a delay drawn
        afresh for every update put two of a device's updates into one round now and then,
        the newer replacing the older (1,000 sparse devices at 2x over the broker, backpressure
        on: 35 % of the updates replaced; 16 % with the fixed phase)."""
        if not self.spreading:
            return 0.0
        return self.phase * (min(self.period, MAX_DELAY_S) if period is None else period)

    def pay(self) -> None:
        """Count an update sent without `take`: the held update a task's end or the stream's
        end sends (`Client.held_update`). The daemon's mirror of this pacer
        (`UpdateQuota.paced`) charges it as any other; unpaid, it left the mirror a send
        behind, and the device's next update was refused (4-31 % of them with short tasks at
        factors 4-8, a reviewer helper's model)."""
        self.credit -= 1.0

    def take(self, now: float | None = None) -> bool:
        """Called for every due update (at time `now`, to measure the period, a pause counted
        as PAUSE_PERIODS periods): True to send it, False to hold it back."""
        if now is not None:
            if self._due_at is not None:
                gap = now - self._due_at
                long = bool(self.period) and gap > PAUSE_PERIODS * self.period
                if long and not self._long:  # a pause, unless the next gap is long too
                    gap = PAUSE_PERIODS * self.period
                self._long = long
                self.period = gap if not self.period else 0.7 * self.period + 0.3 * gap
            self._due_at = now
        self.credit += 1.0 / self.factor  # below 1 after a send: never a burst
        if self.credit >= 1.0 - 1e-9:
            self.credit -= 1.0
            return True
        self.held += 1
        return False
