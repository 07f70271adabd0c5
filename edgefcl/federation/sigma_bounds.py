"""Sigma bounds shared by the Gaussian rules (numpy only, so that every federation module can
import it: the robust sigma floor, the Gaussian strategies and the prototype library).

- `LIK_SIGMA_MAX`: the sigma a client sends for a FedBNN likelihood entry that carries no
  information (its posterior did not narrow); exact in float16 and float32.
- `LIK_FLOOR`: the precision floor of likelihoods, 1 / LIK_SIGMA_MAX^2.
- `median_floor`: the robust floor of a precision-weighted rule, a factor times the senders'
  median sigma per entry, so one sender claiming a tiny sigma cannot take all the weight.
- `precision_capped`: no sender's precision over a share of an entry's total.
- `sigma_ceiling`: a factor times the senders' median sigma (of two the smaller), so one sender
  cannot widen what it shares with another.
"""

from __future__ import annotations

import warnings

import numpy as np

from edgefcl.federation.share_cap import capped_columns

LIK_SIGMA_MAX = 1024.0
"""Sigma a client sends for a likelihood entry it clamped (exact in float16 and float32)."""
LIK_FLOOR = 1.0 / LIK_SIGMA_MAX**2
"""Precision floor of FedBNN likelihoods (sigma >= LIK_SIGMA_MAX)."""


def typical_sigma(sigmas: list[np.ndarray]) -> float:
    """The senders' typical informative sigma: the median over the senders of each one's
    median informative sigma (< LIK_SIGMA_MAX) over every array given (senders x ... each);
    NaN where no sender informs any entry."""
    flat = np.concatenate([np.asarray(s, np.float64).reshape(len(s), -1) for s in sigmas], 1)
    with warnings.catch_warnings():  # a sender that informs nothing: an all-NaN median
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(np.nanmedian(np.nanmedian(np.where(flat < LIK_SIGMA_MAX, flat, np.nan),
                                               axis=1)))


def median_floor(sigmas: np.ndarray, factor: float, informative_only: bool = False,
                 typical: float | None = None) -> np.ndarray:
    """`factor` x the median of `sigmas` over axis 0 (the senders), per entry. With
    `informative_only` (likelihoods) entries at LIK_SIGMA_MAX or above are left out of the
    median, an entry no sender informs gets the floor 0, and an entry one sender alone informs
    (its median is its own) gets `factor` x the senders' typical sigma (`typical_sigma` of
    `sigmas`, or `typical` when given: the round's over all its tensors, so that a tensor the
    others leave wholly uninformative is bounded too; of two senders, their mean), so that one
    sender cannot take every entry the others mark uninformative with a tiny sigma."""
    if not informative_only:
        return factor * np.median(sigmas, axis=0)
    informative = np.where(sigmas < LIK_SIGMA_MAX, sigmas, np.nan)
    with warnings.catch_warnings():  # an entry nobody informed: all-NaN median, no floor
        warnings.simplefilter("ignore", RuntimeWarning)
        floor = np.nan_to_num(factor * np.nanmedian(informative, axis=0), nan=0.0)
    if typical is None:
        typical = typical_sigma([sigmas])
    lone = (~np.isnan(informative)).sum(0) == 1
    if len(sigmas) >= 2 and lone.any() and np.isfinite(typical):
        floor = np.where(lone, np.maximum(floor, factor * typical), floor)
    return floor


def precision_capped(sigmas: np.ndarray, cap: float) -> np.ndarray:
    """`sigmas` (senders x ...) raised so that no sender's precision 1/sigma^2 is over `cap`
    of an entry's total over the senders that inform it (uninformative likelihood entries,
    sigma >= LIK_SIGMA_MAX, count 0); an entry informed by fewer than two is left alone."""
    n = sigmas.shape[0]
    flat = sigmas.reshape(n, -1)
    informed = flat < LIK_SIGMA_MAX
    precision = np.where(informed, 1.0 / np.maximum(flat, 1e-30) ** 2, 0.0)
    count = informed.sum(0)
    out = precision.copy()
    for k in np.unique(count[count >= 2]).tolist():  # at most n groups of entries
        cols = count == k
        out[:, cols] = capped_columns(precision[:, cols], max(cap, 1.0 / k))
    lowered = out < precision
    result = flat.copy()
    result[lowered] = 1.0 / np.sqrt(out[lowered])
    return result.reshape(sigmas.shape)


def sigma_ceiling(sigmas: np.ndarray, factor: float, informative_only: bool = True
                  ) -> np.ndarray:
    """`factor` x the median of `sigmas` (updates x ...) per entry, over the updates that
    inform it (with `informative_only`, uninformative likelihood entries, sigma >=
    LIK_SIGMA_MAX, are left out: they keep their sigma), of two the smaller; infinite where
    none informs it."""
    informed = np.where(sigmas < LIK_SIGMA_MAX, sigmas, np.nan) if informative_only else \
        np.asarray(sigmas, np.float64)
    count = (~np.isnan(informed)).sum(0)
    with warnings.catch_warnings():  # an entry nobody informs: an all-NaN median
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = np.where(count == 2, np.nanmin(informed, 0), np.nanmedian(informed, 0))
    return np.where(count > 0, factor * np.nan_to_num(ref, nan=np.inf), np.inf)
