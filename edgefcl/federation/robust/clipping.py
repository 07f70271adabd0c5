"""Norm clipping: each update's change is scaled down to at most tau in L2 norm, so a scaled or
inflated update moves the global no more than an honest one. A dense update's change is its
delta to the current global (over all float tensors), a Gaussian update's that of its means and
plain tensors (its sigmas are bounded by `sigma_floor.py`); a sparse update's is what it
carries, its entries' values (changes on its base) and its whole tensors' difference to the
current global (`sparse.change_norm`: the entry an update alone sends is averaged over that one
sender, so without this it set the entry by itself, up to the values' bound); an apc update's
(absolute rows and whole tensors) is their difference to the current global
(`sparse.entries_change_norm`), for the same reason. tau is
`fed.clip_norm` when set, else `fed.clip_factor` times the median change norm of the round's
updates that moved (adaptive; with two of them the smaller norm, so that an inflated update
cannot raise its own bound, where their mean would: an honest pair is clipped only when one norm
is over 3 times the other, at the default factor 3; raised towards the recent norms below). A
batch with fewer than three updates that moved (what a round holds after a spill, a shard
worker's flush, a round of two) uses the last RECENT norms of the aggregator's earlier batches
too (`memory`: a batch's norms, a clipped one's counted as tau, or the reference of a batch of
one or two; `reference_norm`): an update alone in its batch is not its own bound."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.robust.sigma_floor import SIGMA
from edgefcl.federation.sparse import (
    change_norm,
    entries_change_norm,
    scaled_change,
    scaled_entries_change,
)
from edgefcl.federation.strategy import Strategy


def delta_norm(tensors: Tensors, global_: Tensors) -> float:
    """L2 norm of tensors - global over the float tensors they share."""
    total = 0.0
    for k, t in tensors.items():
        g = global_.get(k)
        if g is not None and t.dtype.kind == "f" and t.shape == g.shape:
            d = t.astype(np.float64) - g.astype(np.float64)
            total += float(np.dot(d.ravel(), d.ravel()))
    return float(np.sqrt(total))


RECENT = 32
"""Norms of earlier batches that a batch with fewer than three moved updates is clipped with."""


def reference_norm(norms: list[float], recent: Sequence[float] = ()) -> float:
    """The norm the adaptive bound scales: the median of the norms above 0 (an update that
    does not move cannot pull the bound down to nothing); of two the smaller one (their mean,
    the median, would let the larger set its own bound), raised towards the median of the
    `recent` norms of earlier batches but not past the larger (a tiny update would otherwise
    clip an honest one to nothing); one alone, with the recent norms as the first rule has
    them (else it is its own bound); 0 when none moved."""
    moved = np.asarray([n for n in norms if n > 0], np.float64)
    if moved.size == 0:
        return 0.0
    if moved.size >= 3:
        return float(np.median(moved))
    usual = float(np.median(recent)) if len(recent) else None
    if moved.size == 2:
        low, high = float(moved.min()), float(moved.max())
        return low if usual is None else max(low, min(high, usual))
    pool = [float(moved[0]), *recent]
    return min(pool) if len(pool) == 2 else float(np.median(pool))


def clip(update: Update, global_: Tensors, tau: float, norm: float) -> Update:
    """`update` with its delta to `global_` scaled by tau / norm (float32 kept)."""
    s = tau / norm
    tensors = {k: ((global_[k].astype(np.float64)
                    + s * (t.astype(np.float64) - global_[k].astype(np.float64))).astype(t.dtype)
                   if k in global_ and t.dtype.kind == "f" and t.shape == global_[k].shape
                   and not k.endswith(SIGMA) else t) for k, t in update.tensors.items()}
    return replace(update, tensors=tensors)


def means_norm(tensors: Tensors, global_: Tensors) -> float:
    """A Gaussian update's change: of its means and plain tensors (its sigmas are bounded by
    `sigma_floor.py`; `clip` leaves them as they are)."""
    return delta_norm({k: t for k, t in tensors.items() if not k.endswith(SIGMA)}, global_)


def clip_sparse(update: Update, global_: Tensors, tau: float, norm: float) -> Update:
    """A sparse `update` with its change scaled by tau / norm (`sparse.scaled_change`)."""
    return replace(update, tensors=scaled_change(update.tensors, tau / norm, global_))


def clip_entries(update: Update, global_: Tensors, tau: float, norm: float) -> Update:
    """An update of absolute entries (apc) with its change on `global_` scaled by tau / norm
    (`sparse.scaled_entries_change`)."""
    return replace(update, tensors=scaled_entries_change(update.tensors, tau / norm, global_))


FORMS: dict[str, tuple[Callable[[Tensors, Tensors], float],
                       Callable[[Update, Tensors, float, float], Update]]] = {
    "dense": (delta_norm, clip),
    "sparse": (change_norm, clip_sparse),
    "gaussian": (means_norm, clip),
    "entries": (entries_change_norm, clip_entries),
}
"""Decoded form -> (the norm of an update's change, the clip that scales it to tau)."""


def apply(updates: list[Update], global_: Tensors, fed: FedConfig,
          counters: Counter, form: str = "dense", memory: dict | None = None,
          strategy: Strategy | None = None) -> list[Update]:
    """Clip dense, sparse, apc and Gaussian updates (other forms pass through); `memory`
    keeps the recent norms (`reference_norm`)."""
    if form not in FORMS or (fed.clip_norm <= 0 and fed.clip_factor <= 0) or not updates:
        return updates
    norm_of, clip_to = FORMS[form]
    norms = [norm_of(u.tensors, global_) for u in updates]
    recent: deque[float] = deque(maxlen=RECENT) if memory is None else memory.setdefault(
        f"clip_norms_{form}", deque(maxlen=RECENT))
    ref = reference_norm(norms, recent)
    tau = fed.clip_norm if fed.clip_norm > 0 else fed.clip_factor * ref
    moved = [n for n in norms if n > 0]
    # a batch of one or two is remembered by its reference: a pair's norms, clipped at tau,
    # let an inflated update fill half the memory and raise its own bound about 1.5x every 16
    # rounds, and so did one alone taking turns with honest ones
    recent.extend([ref] if len(moved) < 3 else [min(n, tau) for n in moved])
    out = []
    for u, n in zip(updates, norms, strict=True):
        if n > tau:
            counters["clipped"] += 1
            u = clip_to(u, global_, tau, n)
        out.append(u)
    return out
