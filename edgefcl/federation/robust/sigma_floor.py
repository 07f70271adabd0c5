"""Sigma ceiling, sigma floor and precision cap for Gaussian updates, for any number of updates
and every rule (conflation, fedbnn, moments):
0. under a rule whose sigmas add up (`Strategy.adds_variances`: moments), every `::sigma`
   entry is lowered to at most `fed.clip_factor` times the round's median sigma of that entry
   (of two, the smaller; one alone, at most the current global's: 3x that let one device
   alone in each of a worker's flushes widen it 12 % a round), so one update cannot widen the
   global: a sigma of 1e6 among five of 0.1 made the global's 2.9e5 (under the
   precision-weighted rules a wide sigma weighs nothing, and FedBNN's likelihood sigmas are
   wide by nature: 1.6 million entries a run would be lowered);
1. every `::sigma` entry is raised to at least `fed.sigma_floor` times the round's median
   sigma of that entry (the median of two is their mean), so a tiny sigma gets no enormous
   precision;
2. then no update's precision may exceed `max_share` of the round's total precision of an
   entry (`max_share` 0: the share cap's default, 2/n and at most 1/2; with two updates an
   equal share): an update over it gets its sigma raised until it holds exactly that share.
FedBNN likelihood entries a client marks as carrying no information (sigma = LIK_SIGMA_MAX)
are left out of both: of the median (they would raise the floor of informative entries) and
of the cap. An entry only one update informs (any rule) gets the floor of the round's
typical sigma over all its tensors instead (one device sending 1e-30 took every entry the
others left uninformative, and held it against them: `sigma_bounds.median_floor`)
(`federation/sigma_bounds.py`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.share_cap import default_cap
from edgefcl.federation.sigma_bounds import (
    median_floor,
    precision_capped,
    sigma_ceiling,
    typical_sigma,
)
from edgefcl.federation.strategy import Strategy

SIGMA = "::sigma"


def apply(updates: list[Update], global_: Tensors, fed: FedConfig,
          counters: Counter, form: str = "gaussian", memory: dict | None = None,
          strategy: Strategy | None = None) -> list[Update]:
    if form != "gaussian" or not updates:
        return updates
    ceiled = fed.clip_factor > 0 and strategy is not None and strategy.adds_variances
    if len(updates) < 2 and not ceiled:
        return updates
    names = [k for k in updates[0].tensors if k.endswith(SIGMA)]
    cap = fed.max_share if fed.max_share > 0 else default_cap(len(updates))
    stacked = {k: np.stack([u.tensors[k] for u in updates]).astype(np.float64) for k in names}
    typical = typical_sigma(list(stacked.values())) \
        if names and len(updates) >= 2 and fed.sigma_floor > 0 else None
    new = {}
    for k, sigmas in stacked.items():
        raised = sigmas
        if ceiled:  # one alone (a spill, a worker's flush): never wider than the global
            ceiling = (sigma_ceiling(sigmas, fed.clip_factor) if len(updates) > 1
                       else global_[k].astype(np.float64))
            raised = np.minimum(sigmas, ceiling)
            counters["sigma_ceiled"] += int((raised < sigmas).sum())
        if len(updates) < 2:
            new[k] = raised
            continue
        if fed.sigma_floor > 0:
            floored = np.maximum(raised, median_floor(sigmas, fed.sigma_floor,
                                                      informative_only=True, typical=typical))
            counters["sigma_floored"] += int((floored > raised).sum())
            raised = floored
        if fed.max_share < 1:
            capped = precision_capped(raised, cap)
            counters["sigma_share_capped"] += int((capped > raised).sum())
            raised = capped
        new[k] = raised
    out = []
    for i, u in enumerate(updates):
        changed = {k: new[k][i].astype(u.tensors[k].dtype) for k in names
                   if (new[k][i] != u.tensors[k]).any()}
        out.append(replace(u, tensors=u.tensors | changed) if changed else u)
    return out
