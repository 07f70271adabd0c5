"""Device-side merge rules: how a device takes a global it took part in while it kept
training (async). One function per rule; `MERGES` is the registry, `get_merge` looks one up.

Each rule gets the global decoded into model state (`merged`), the model now (`now`), the
state it last sent (`sent`), the names of the learned parameters (statistics such as
BatchNorm running means and variances always take the global's value: a variance moved by a
delta can turn negative) and `tau`, the versions the global moved on since the base of the
update it counts. `merge_global` is the async device's one decision, shared by the daemon's
device (`runtime/device_runner.py`) and the in-process simulator (`edgefcl.asyncsim`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefcl.config import ConfigError, FedConfig
from edgefcl.federation.messages import GlobalModel
from edgefcl.federation.staleness import staleness_rule

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class MergeRule:
    """One merge rule: `keeps_local` says whether the device's prototype rows keep their
    progress since sending too (row = global + now - sent); `by_staleness` whether the local
    progress added back is weighed by the run's staleness rule."""

    name: str
    apply: Callable[[State, State, State | None, set[str], float], State]
    keeps_local: bool
    by_staleness: bool = False

    def local_weight(self, fed: FedConfig, tau: int) -> float:
        """The weight of the local progress this rule adds back: s(tau) or 1."""
        if not self.by_staleness:
            return 1.0
        return staleness_rule(fed.staleness, fed.staleness_a, fed.staleness_b)(tau)


def replace(merged: State, now: State, sent: State | None, params: set[str],
            weight: float) -> State:
    """theta = theta_global (lock-step, Algorithm 1)."""
    return merged


def delta(merged: State, now: State, sent: State | None, params: set[str],
          weight: float) -> State:
    """theta = theta_global + weight * (theta_now - theta_sent) for the learned parameters:
    the progress made since the update was sent is kept (weight 1: the plain delta merge)."""
    if sent is None:
        return merged
    return {k: merged[k] + weight * (now[k] - sent[k]) if k in params else merged[k]
            for k in merged}


MERGES = {r.name: r for r in (
    MergeRule("replace", replace, False),
    MergeRule("delta", delta, True),
    MergeRule("staleness", delta, True, by_staleness=True),
)}
"""Rule name -> rule. `staleness` is the delta merge with weight s(tau) of the run's
staleness rule (`--staleness`): the further the global moved on, the less local drift is
added to it."""

REPLACE = MERGES["replace"]
MERGED, CAUGHT_UP = "merged", "caught_up"
"""What `merge_global` did."""


def get_merge(name: str) -> MergeRule:
    """The merge rule `name`; ConfigError listing the rules otherwise."""
    rule = MERGES.get(name)
    if rule is None:
        raise ConfigError(f"unknown device_merge '{name}'; choose from {', '.join(MERGES)}")
    return rule


def merge_global(client: Any, g: GlobalModel, fed: FedConfig) -> str | None:
    """Async: what a device does with the newest global `g` before its next mini-batch.
    "merged" when it took part (the run's `device_merge` rule; where `g` holds an older
    update than the device's newest sent, it keeps its progress since that one:
    `Client.apply_global`), "caught_up" when it did not
    but is more than half of `max_staleness` versions behind (back from a reboot or a long
    outage: its updates would soon all be rejected as stale, so it catches up with the
    delta rule), None when it keeps training on its own model."""
    if g.version <= client.version:
        return None
    if client.cid in g.participants:
        client.apply_global(g, get_merge(fed.device_merge))
        return MERGED
    if g.version - client.version > fed.max_staleness // 2:
        client.apply_global(g, MERGES["delta"])
        return CAUGHT_UP
    return None


def rejoin(client: Any, g: GlobalModel) -> None:
    """Take `g` whole, older than the version the device holds: that version is not its
    aggregator's (a forged global far ahead, or a new run under the same fleet name), and
    without this no later global would be newer (`merge_global` would skip them all)."""
    client.apply_global(g, REPLACE)


def merge_at_gate(client: Any, g: GlobalModel, fed: FedConfig) -> str | None:
    """Async, when the task gate opens (every device finished the task): the device takes
    the newest global by the run's `device_merge` rule whether or not it lists the device. It
    holds the fleet's end-of-task models, and the device's own last update was folded into it
    or into a global before it (the device has not trained since it sent it, so the delta and
    replace rules agree), or it waits in the next round: where `g` holds an older update of the
    device, the device keeps its progress since that one."""
    if g.version <= client.version:
        return None
    client.apply_global(g, get_merge(fed.device_merge))
    return MERGED
