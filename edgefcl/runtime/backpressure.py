"""Backpressure: an aggregator that receives more than it folds asks its devices to send less.

Aggregator side (`Backpressure`): every status interval the daemon hands over what its inbox
saw in that interval (`Load`): messages offered by the network thread (queued + shed), messages
shed, messages the main loop took out, and the mean inbox fill. The factor (>= 1, at most
`fed.max_backpressure`) is published on the retained config and status with its reason:

- shed > 0 ("shed") or mean fill >= HIGH_FILL ("fill"): factor x max(offered / taken, STEP);
- offered / taken > 1 + SLACK ("behind": arrivals outrun the folds): factor x offered / taken;
- mean fill < LOW_FILL, nothing shed and offered / taken <= 1 + SLACK: factor x DECAY (back
  towards 1 as the load falls);
- otherwise the factor holds.

The interval after a rise is not measured (the factor holds): devices react within one update
period, so that interval's arrivals still mix the old and the new rate, and measuring them would
raise the factor twice for one overload.

Device side (`Pacer`): with factor f a device sends one of every f updates its burn-in / jump
schedule makes due (a credit of 1 / f per due update; fractional factors average out), i.e.
its jump becomes jump x f. A held update consumes its sequence number (the aggregator's
admission bounds the mini-batch by the sequence number) and is never encoded, so error feedback
and the async delta rule see only what was sent; the next update carries the progress.
Lock-step mode never uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HIGH_FILL = 0.5
LOW_FILL = 0.1
SLACK = 0.1
STEP = 1.25
DECAY = 0.9


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


class Backpressure:
    """The factor an aggregator advertises, updated once per status interval."""

    def __init__(self, max_factor: float) -> None:
        self.max_factor = max(1.0, float(max_factor))
        self.factor = 1.0
        self.reason = ""
        self._settling = False

    @property
    def enabled(self) -> bool:
        return self.max_factor > 1.0

    def update(self, load: Load) -> float:
        """The new factor after an interval with `load` (also sets `reason`)."""
        if not self.enabled:
            return self.factor
        ratio = load.offered / max(load.taken, 1)
        prev = self.factor
        if self._settling:
            self._settling = False
            return prev
        if load.shed > 0:
            new, why = prev * max(ratio, STEP), "shed"
        elif load.fill >= HIGH_FILL:
            new, why = prev * max(ratio, STEP), "fill"
        elif ratio > 1 + SLACK:
            new, why = prev * ratio, "behind"
        elif load.fill < LOW_FILL:
            new, why = prev * DECAY, self.reason
        else:
            new, why = prev, self.reason
        self.factor = round(min(max(new, 1.0), self.max_factor), 2)
        self._settling = self.factor > prev
        self.reason = why if self.factor > 1.0 else ""
        return self.factor

    def fields(self) -> dict[str, float | str]:
        """What the config and status carry (nothing when backpressure is off)."""
        if not self.enabled:
            return {}
        return {"backpressure": self.factor, "backpressure_reason": self.reason}


def advertised(body: dict | None, max_factor: float) -> float:
    """The factor a config or status body advertises, within [1, max_factor] (1 when absent or
    malformed: a device is never silenced by a message it cannot read)."""
    value = (body or {}).get("backpressure", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 1.0
    return min(max(float(value), 1.0), max(1.0, max_factor))


class Pacer:
    """Which due updates a device sends under backpressure: one in `factor`."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.credit = 0.0
        self.held = 0

    def take(self) -> bool:
        """Called for every due update: True to send it, False to hold it back."""
        self.credit += 1.0 / self.factor  # below 1 after a send: never a burst
        if self.credit >= 1.0 - 1e-9:
            self.credit -= 1.0
            return True
        self.held += 1
        return False
