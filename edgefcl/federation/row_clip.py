"""Norm clipping of prototype rows, as `robust/clipping.py` clips dense deltas: a row's change
from the previous global's row of its label (the zero row for a new label) is scaled down to
at most `factor` times the round's median sender norm, where a sender's norm is the median
change of the rows it sent. One device's rows (a bias of 1e6 for one label, say) then cannot
outgrow the honest rows of the round. As with dense clipping the median is robust while the
honest senders are the majority; of two senders the smaller counts (their median would be
their mean). The change is also bounded by `factor` times the previous global's median row
norm, which no sender of the round holds. Senders whose rows did not change are left out of
the median. Last, each row's own norm is clipped to `factor` times the round's median sender
row norm, a bound the previous global does not move.

Those bounds are on a row's size, not on where it points: one sender moving every row of its
by the same bounded bias still took 0.96 of the predictions over 20 rounds under the mean
rule. So first, per label sent by three senders or more, each row's distance from the label's
coordinate-wise median row is clipped to `factor` times the median distance of that label's
rows (centred clipping, Karimireddy et al. 2021): a minority's rows are pulled into the honest
spread, and the mean that follows moves by at most that spread over the senders' count.
Depends on numpy only (the prototype library imports it)."""

from __future__ import annotations

from collections import Counter

import numpy as np


def clip_rows(rows: np.ndarray, base: np.ndarray, sender: np.ndarray, factor: float,
              counters: Counter | None = None, reference: np.ndarray | None = None,
              label: np.ndarray | None = None) -> np.ndarray:
    """`rows` (n, width) clipped towards their label's median row (`label` (n,): each row's
    label index; see `clip_to_centre`), then with each row's change from `base` (its label's
    previous row, same shape) clipped to `factor` x the median over senders of their median
    change, and to `factor` x the median norm of the `reference` rows (the previous global
    library: no sender of this round holds it) where there are some; `sender` (n,) names each row's
    sender. Unchanged with `factor` 0, or with fewer than two senders and no reference."""
    if factor > 0 and label is not None:
        rows = clip_to_centre(rows, label, factor, counters)
    senders = np.unique(sender)
    have_reference = reference is not None and len(reference) > 0
    if factor <= 0 or len(rows) == 0 or (len(senders) < 2 and not have_reference):
        return rows
    delta = rows - base
    norms = np.linalg.norm(delta, axis=1)
    tau = np.inf
    if len(senders) >= 2:
        per_sender = np.array([np.median(norms[sender == s]) for s in senders])  # few senders
        moved = per_sender[per_sender > 0]  # one that did not move cannot pull tau to nothing
        if len(moved) >= 2:  # of two the smaller, as dense clipping: their median is the mean
            tau = factor * float(moved.min() if len(moved) == 2 else np.median(moved))
    if have_reference:
        tau = min(tau, factor * float(np.median(np.linalg.norm(reference, axis=1))))
    over = norms > tau
    if over.any():
        if counters is not None:
            counters["prototype_rows_clipped"] += int(over.sum())
        rows = base + delta * np.where(over, tau / np.maximum(norms, 1e-30), 1.0)[:, None]
    return _clip_norms(rows, sender, senders, factor, counters)


def _clip_norms(rows: np.ndarray, sender: np.ndarray, senders: np.ndarray, factor: float,
                counters: Counter | None) -> np.ndarray:
    """Each row's own norm to `factor` x the median over the round's senders of their median
    row norm (of two, the smaller): a bound that the previous global does not set, so that
    rows clipped by their change cannot creep further round after round (two senders biasing
    every row by 1e6 moved the rows by 3-4 a round without it)."""
    if len(senders) < 2:
        return rows
    norms = np.linalg.norm(rows, axis=1)
    per_sender = np.array([np.median(norms[sender == s]) for s in senders])
    tau = factor * float(per_sender.min() if len(per_sender) == 2 else np.median(per_sender))
    over = norms > tau
    if not over.any() or tau <= 0:
        return rows
    if counters is not None:
        counters["prototype_rows_norm_clipped"] += int(over.sum())
    return rows * np.where(over, tau / np.maximum(norms, 1e-30), 1.0)[:, None]


def clip_to_centre(rows: np.ndarray, label: np.ndarray, factor: float,
                   counters: Counter | None = None) -> np.ndarray:
    """Per label with three rows or more (one per sender), each row's distance from the
    label's coordinate-wise median row clipped to `factor` x the median of those distances;
    labels with fewer rows are left as they are (of two, the median is their mean)."""
    order = np.argsort(label, kind="stable")
    bounds = np.cumsum(np.bincount(label))[:-1]
    out = rows.copy()
    clipped = 0
    for at in np.split(order, bounds):  # one pass per label, a few hundred at most
        if len(at) < 3:
            continue
        group = rows[at]
        centre = np.median(group, axis=0)
        dist = np.linalg.norm(group - centre, axis=1)
        tau = factor * float(np.median(dist))
        over = dist > tau
        if over.any():
            clipped += int(over.sum())
            scale = np.where(over, tau / np.maximum(dist, 1e-30), 1.0)[:, None]
            out[at] = centre + (group - centre) * scale
    if counters is not None and clipped:
        counters["prototype_rows_centre_clipped"] += clipped
    return out
