"""Sparse globals: each new global version changes at most a fraction of every tensor's
entries, the largest changes; the rest of the change stays on the aggregator as a residual that
later versions send (error feedback on the downlink, as EF21-P).

With `--global-topk F` the aggregator's round result R (the rule's new tensors) is not
published as it is. Per float tensor of more than ALWAYS_WHOLE entries it keeps the target
T = R + r (r: the residual so far), publishes P' = P + top_k(T - P), the previous global P
changed in the k = ceil(F x size) entries where |T - P| is largest, and keeps r' = T - P'. Small
tensors (biases, BatchNorm statistics) and integer ones change whole. P' is the global every
device holds and every base refers to (history, folds, sparse decoding), so nothing downstream
changes; a delta downlink (`--downlink sparse`, or `auto`) then carries about F of the model
per version instead of all of it. Without a residual the skipped change would be lost; with it,
every entry's change arrives once it is among the largest. The residual is not saved: a
restarted aggregator goes on from the published global (what its devices hold) and the unsent
remainder of the change is dropped."""

from __future__ import annotations

import math

import numpy as np

Tensors = dict[str, np.ndarray]

ALWAYS_WHOLE = 1024
"""Tensors of at most this many entries change whole (their indices would cost as much)."""


def sparse_step(held: Tensors, result: Tensors, residual: Tensors,
                fraction: float) -> tuple[Tensors, Tensors]:
    """(the global to publish, the new residual) from the global held by devices `held`, the
    round's result and the residual so far, changing at most ceil(`fraction` x size) entries
    of each large float tensor (deterministic: the same inputs give the same global)."""
    out: Tensors = {}
    kept: Tensors = {}
    for name, r in result.items():
        p = held.get(name)
        if (p is None or p.shape != r.shape or r.dtype.kind != "f"
                or r.size <= ALWAYS_WHOLE):
            out[name] = r
            continue
        target = r + residual[name] if name in residual else r
        change = (target - p).ravel()
        k = max(1, math.ceil(fraction * change.size))
        if k >= change.size:
            out[name] = target.astype(r.dtype, copy=False)
            continue
        top = np.argpartition(-np.abs(change), k - 1, kind="introselect")[:k]
        new = p.copy().ravel()
        new[top] = target.ravel()[top]
        out[name] = new.reshape(r.shape).astype(r.dtype, copy=False)
        kept[name] = (target - out[name]).astype(r.dtype, copy=False)
    return out, kept
