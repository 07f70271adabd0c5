"""The share cap's arithmetic (water-filling), used by the robust share rule
(`robust/share.py`, one weight per update) and by the prototype library (one weight per row
of a label, `federation/prototype_library.py`). Depends on numpy only."""

from __future__ import annotations

import numpy as np


def default_cap(n: int) -> float:
    """The cap of `max_share` 0 among n weights: twice an equal share, and never more than
    half, so that no one outweighs all the others together (two members: an equal share)."""
    return min(2.0 / n, 0.5) if n >= 2 else 1.0


def capped_weights(weights: np.ndarray, cap: float) -> np.ndarray:
    """Weights whose shares are all <= cap (cap >= 1/len); unchanged when already so."""
    w = np.asarray(weights, np.float64)
    n = len(w)
    cap = max(cap, 1.0 / n)
    if n == 0 or w.sum() <= 0 or (w / w.sum()).max() <= cap:
        return w
    order = np.argsort(-w)
    for k in range(1, n + 1):  # clamp the k largest to cap * total
        rest = w[order[k:]].sum()
        total = rest / (1.0 - k * cap) if k * cap < 1 else np.inf
        if k == n or w[order[k]] <= cap * total:
            out = w.copy()
            out[order[:k]] = cap * total if np.isfinite(total) else 1.0
            return out
    return w


def capped_groups(weights: np.ndarray, groups: np.ndarray, max_share: float) -> np.ndarray:
    """`capped_weights` applied within every group of two or more members (the rows sent
    for one prototype label): cap `max_share`, 0: `default_cap` of the group's members;
    `max_share` >= 1: unchanged."""
    w = np.asarray(weights, np.float64)
    if max_share >= 1 or len(w) < 2:
        return w
    out = w.copy()
    order = np.argsort(groups, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(groups[order]) != 0])
    for members in np.split(order, starts[1:]):  # loops over groups, not members
        if len(members) >= 2:
            cap = max_share if max_share > 0 else default_cap(len(members))
            out[members] = capped_weights(w[members], cap)
    return out


def capped_columns(weights: np.ndarray, cap: float) -> np.ndarray:
    """`capped_weights` on every column of `weights` (members x entries) at once: each
    member's share of a column is at most `cap` (at least 1/members). A column that needs
    every member at the cap (cap = 1/members) gets every member at its smallest positive
    weight (members of weight 0 stay 0)."""
    w = np.asarray(weights, np.float64)
    n = w.shape[0]
    if n < 2:
        return w
    cap = max(cap, 1.0 / n)
    total = w.sum(0)
    over = (w > cap * total * (1 + 1e-12)).any(0)  # a tie is within the cap
    if not over.any():
        return w
    col = w[:, over]
    desc = -np.sort(-col, axis=0)
    rest = np.cumsum(desc[::-1], axis=0)[::-1]  # rest[k]: sum of all but the k largest
    k = np.arange(1, n)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.where(k * cap < 1, cap * rest[1:] / (1 - k * cap), np.inf)
    # capping the k largest at `level` leaves the rest under it (a tie is no overshoot)
    fits = desc[1:] <= level * (1 + 1e-12)
    first = np.where(fits.any(0), fits.argmax(0), n - 1)
    chosen = level[np.minimum(first, n - 2), np.arange(col.shape[1])]
    smallest = np.where(desc > 0, desc, np.inf).min(0)
    chosen = np.where(np.isfinite(chosen) & fits.any(0), chosen, smallest)
    out = w.copy()
    out[:, over] = np.minimum(col, chosen)
    return out


def capped_member_columns(weights: np.ndarray, members: np.ndarray, cap: float) -> np.ndarray:
    """`capped_columns` for groups of identical members: `weights` (groups x entries) is the
    weight of each member of a group, `members` how many members each group has; returns the
    capped weight of each group's members, so that no member holds more than `cap` of a
    column (at least 1/members in all). A shard root caps partials this way, each spread over
    its participants, without a row per participant."""
    w = np.asarray(weights, np.float64)
    n = np.asarray(members, np.float64)
    cap = max(cap, 1.0 / n.sum())
    total = (n[:, None] * w).sum(0)
    over = (w > cap * total * (1 + 1e-12)).any(0)  # a tie is within the cap
    if not over.any():
        return w
    col = w[:, over]
    order = np.argsort(-col, axis=0, kind="stable")
    desc = np.take_along_axis(col, order, 0)
    counts = n[order]
    above = np.cumsum(counts, 0)  # members of the k largest groups
    tail = np.cumsum((counts * desc)[::-1], 0)[::-1]  # from each group down (no cancellation)
    rest = np.vstack([tail[1:], np.zeros((1, col.shape[1]))])  # all but the k largest groups
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.where(cap * above < 1, cap * rest / (1 - cap * above), np.inf)
    nxt = np.vstack([desc[1:], np.zeros((1, col.shape[1]))])
    fits = (nxt <= level * (1 + 1e-12)) & np.isfinite(level)  # a tie is no overshoot
    first = np.where(fits.any(0), fits.argmax(0), len(w) - 1)
    chosen = level[first, np.arange(col.shape[1])]
    smallest = np.where(desc > 0, desc, np.inf).min(0)
    chosen = np.where(np.isfinite(chosen) & fits.any(0), chosen, smallest)
    out = w.copy()
    out[:, over] = np.minimum(col, chosen)
    return out
