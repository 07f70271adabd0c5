"""Sparse globals: each new global version changes at most a fraction of every large tensor's
entries, the largest changes; the rest of the change stays on the aggregator and later versions
send it (error feedback on the downlink, as EF21-P).

With `--global-topk F` the aggregator keeps two models: the published global P, which every
device holds and every base refers to (history, folds' bases, sparse decoding), and the model
its rounds fold into, the target T of the last round (`Aggregator.server_global`). Per float
tensor of more than ALWAYS_WHOLE entries it publishes P' = P + top_k(T - P), the previous
global changed in the k = ceil(F x size) entries where |T - P| is largest; small tensors
(biases, BatchNorm statistics) and integer ones change whole. The difference T - P' is what
later versions send. The task gate's round publishes T whole, the global every device
evaluates the finished task on. A delta downlink (`--downlink sparse`, or `auto`) then carries
about F of the model per version instead of all of it, and every entry's change arrives once
it is among the largest. T is not saved: a restarted aggregator goes on from the published
global (what its devices hold) and the unsent part of the change is dropped."""

from __future__ import annotations

import math

import numpy as np

Tensors = dict[str, np.ndarray]

ALWAYS_WHOLE = 1024
"""Tensors of at most this many entries change whole (their indices would cost as much)."""


def sparse_step(held: Tensors, target: Tensors, fraction: float) -> Tensors:
    """The global to publish from the global devices hold and the round's target: each large
    float tensor changed in at most ceil(`fraction` x size) entries, those whose change is
    largest; other tensors as in `target` (the same arrays). Deterministic."""
    out: Tensors = {}
    for name, t in target.items():
        p = held.get(name)
        k = max(1, math.ceil(fraction * t.size))
        if (p is None or p.shape != t.shape or t.dtype.kind != "f"
                or t.size <= ALWAYS_WHOLE or k >= t.size):
            out[name] = t
            continue
        top = np.argpartition(-np.abs((t - p).ravel()), k - 1)[:k]
        new = p.copy().ravel()
        new[top] = t.ravel()[top]
        out[name] = new.reshape(t.shape)
    return out
