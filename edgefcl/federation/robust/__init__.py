"""Robust aggregation: rules that keep a few faulty or malicious updates from steering the
global model. Each rule is one module with one job; `ROUND_RULES` lists the rules applied to
a round's accepted updates before the strategy averages them, in order.

| rule                       | module          | dense | sparse/apc | gaussian | default          |
|----------------------------|-----------------|-------|------------|----------|------------------|
| BatchNorm variances > 0    | variance.py     | yes   | dense parts| plain    | always (reject)  |
| norm clipping of deltas    | clipping.py     | yes   | no         | no       | 3 x median norm  |
| weight share cap           | share.py        | yes   | yes        | plain+mm | 2 / participants |
| sigma floor                | sigma_floor.py  | no    | no         | yes      | 0.5 x median     |
| coordinate-wise median     | median.py       | yes   | no         | no       | --aggregation    |
| trimmed mean               | trimmed_mean.py | yes   | no         | no       | --aggregation    |

Clipping and the coordinate-wise rules need whole tensors, which sparse and apc updates are
not (they carry a subset of entries relative to the client's base), so only the share cap
protects those; Gaussian updates get the sigma floor (precision rules) and the share cap
(sample-weighted parts: plain tensors and moment matching). Conflation counts every client
once, so the share cap does not apply to its Gaussians; the sigma floor does.
Sync (lock-step) ticks and async rounds of median / trimmed mean buffer the round's updates
and apply `ROUND_RULES` at close (median and trimmed mean are not sums: an async round of them
keeps every update until it closes, memory grows with the round's participants). Async rounds
of every other (sum-decomposable) strategy fold each update on arrival after the online
versions of the rules (`online.py`: clipping at `clip_factor` x the median of the last 64 delta
norms, weight capped at 2 x the median of the last 64 weights, sigma floor from the last 64
updates' median sigmas), so their memory does not grow with the number of clients.
With all rules off (`clip_factor 0`, `max_share 1`, `sigma_floor 0`) the aggregation is the
plain one, bit for bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.robust import clipping, share, sigma_floor
from edgefcl.federation.robust import median as median  # noqa: F401  (registers strategies)
from edgefcl.federation.robust import trimmed_mean as trimmed_mean  # noqa: F401
from edgefcl.federation.robust.variance import check_variances

Rule = Callable[[list[Update], Tensors, FedConfig, Counter], list[Update]]

ROUND_RULES: dict[str, Rule] = {
    "clipping": clipping.apply,
    "sigma_floor": sigma_floor.apply,
    "share": share.apply,
}
"""Rules applied, in this order, to a round's updates (sorted by client) before averaging."""


BUFFERED_AGGREGATIONS = ("median", "trimmed-mean")
"""Aggregations that are not sums: an async round buffers their updates until it closes."""


def buffers_round(fed: FedConfig) -> bool:
    """Whether an async round of `fed` keeps its updates until it closes (rules at close)."""
    return fed.aggregation in BUFFERED_AGGREGATIONS


def prepare_round(updates: list[Update], global_: Tensors, fed: FedConfig,
                  counters: Counter) -> list[Update]:
    """The round's updates after every robust rule (unchanged when all are off)."""
    for rule in ROUND_RULES.values():
        updates = rule(updates, global_, fed, counters)
    return updates


__all__ = ["BUFFERED_AGGREGATIONS", "ROUND_RULES", "buffers_round", "check_variances",
           "prepare_round"]
