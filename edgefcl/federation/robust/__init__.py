"""Robust aggregation: rules that keep a few faulty or malicious updates from steering the
global model. Each rule is one module with one job; `ROUND_RULES` lists the rules applied to
a round's accepted updates before the strategy averages them, in order.

| rule                       | module          | dense | sparse/apc | gaussian | default          |
|----------------------------|-----------------|-------|------------|----------|------------------|
| BatchNorm variances > 0    | variance.py     | yes   | dense parts| plain    | always (reject)  |
| norm clipping of changes   | clipping.py     | yes   | yes        | means    | 3 x median norm  |
| class claims bound         | class_claims.py | class-weighted rule         | 4 x lower median |
| weight share cap           | share.py        | yes   | yes        | plain+mm | 2/n, <= 1/2      |
| sigma ceiling and floor    | sigma_floor.py  | no    | no         | yes      | 3x, 0.5x median  |
| coordinate-wise median     | median.py       | yes   | no         | no       | --aggregation    |
| trimmed mean               | trimmed_mean.py | yes   | no         | no       | --aggregation    |
| label room (new labels)    | label_room.py   | library (any encoding)      | 2/n x 1,024, <= 512 |

The coordinate-wise rules need whole tensors, which sparse and apc updates are not (they
carry a subset of entries). A sparse update's entries are changes on its base, so its change
is clipped like a dense update's (`clipping.py`); apc's entries are absolute values, whose
change is their difference to the global, clipped the same way (the apc knowledge base has
its own bounds: `apc_rule.APCFedAvg`). Gaussian updates get their means' change clipped, the
sigma ceiling (moment matching), the sigma floor (precision rules) and the share cap
(sample-weighted parts: plain tensors and moment matching). Conflation counts every client
once, so the share cap does not apply to its Gaussians; the sigma floor does.
The label room is applied by the aggregator to the round's prototype libraries (one device's
invented labels cannot fill the global library); like the share cap, `max_share` sets it.
With all rules off (`clip_factor 0`, `max_share 1`, `sigma_floor 0`) the aggregation is the
plain one, bit for bit.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.robust import class_claims, clipping, share, sigma_floor
from edgefcl.federation.robust.variance import check_variances
from edgefcl.federation.strategy import Strategy

Rule = Callable[[list[Update], Tensors, FedConfig, Counter, str, dict, Strategy | None],
                list[Update]]
"""(updates, current global, options, counters, form of the decoded updates: the encoding's
`form`, dense | sparse | entries | gaussian, memory: what the rules keep from one batch of
updates to the next, one dict per aggregator, the strategy that averages them: what it
declares, such as `weights_by_class`) -> updates."""

ROUND_RULES: dict[str, Rule] = {
    "clipping": clipping.apply,
    "sigma_floor": sigma_floor.apply,
    "class_claims": class_claims.apply,
    "share": share.apply,
}
"""Rules applied, in this order, to a round's updates (sorted by client) before averaging."""


def copy_memory(memory: dict) -> dict:
    """A copy of the rules' memory (a round dropped after it changed goes back to this)."""
    return {k: deque(v, v.maxlen) for k, v in memory.items()}


def load_memory(saved: object) -> dict:
    """The rules' memory from `{name: list of norms}` (an aggregator's saved state); what is
    not a list of finite norms >= 0 is left out (an empty memory is always safe: a NaN norm
    made every bound NaN, and nothing was clipped)."""
    if not isinstance(saved, dict):
        return {}
    return {str(k): deque(map(float, v), clipping.RECENT) for k, v in saved.items()
            if isinstance(v, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                and x >= 0 for x in v)}


def prepare_round(updates: list[Update], global_: Tensors, fed: FedConfig,
                  counters: Counter, form: str = "dense",
                  memory: dict | None = None, strategy: Strategy | None = None) -> list[Update]:
    """The round's (decoded) updates after every robust rule (unchanged when all are off);
    `form` is the encoding's decoded form; `memory`: the aggregator's dict in which the rules
    keep what they need of its earlier batches (None: none); `strategy`: the aggregator's."""
    memory = {} if memory is None else memory
    for rule in ROUND_RULES.values():
        updates = rule(updates, global_, fed, counters, form, memory, strategy)
    return updates


__all__ = ["ROUND_RULES", "check_variances", "copy_memory", "load_memory", "prepare_round"]
