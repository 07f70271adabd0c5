"""The prototype head at the aggregator (FedBNN §IV-B, Algorithm 1 line 11): its federation
rule, `PrototypeRows`, registered as the `prototypes` head's `rows` in `federation/heads.py`
(nothing else imports this module).

A library (`label_rows.LabelRows`) maps label NAMES to classifier rows with the number of
samples of that label behind the row. Devices send the rows of the labels they trained on; the
aggregator averages the rows per label, weighted by that label's samples, mixes each with the
previous global's row of the same label (the same smoothing as the other tensors) and
publishes the whole library with the global, so a device learns of labels it has never met.

Gaussian libraries (encoding gaussian): every row also has a sigma row (`sigmas`, > 0, the
rows' shape; the device keeps rho = softplus^-1(sigma), as the Bayesian layers do). A label's
rows are then combined as Gaussians (`combine_gaussian`): sample-weighted conflation (each
sender's precision scaled by its share-capped sample weight, so equal counts give plain
conflation) after the sigma floor of the robust rules (`fed.sigma_floor` x the median sigma of
the label's senders, three senders or more), then the moment-matched mixture with the previous
global's row (`federation.gaussian.mix_gaussian`). With the fedbnn aggregation rule the rows
follow the extractor's rule instead (FedBNN Eq. 9, `product_gaussian`): devices send their rows'
likelihoods (posterior / the row's prior), and the aggregator multiplies the label's prior (the
previous global's row, N(0, bayes_sigma) for a new label) by them; rows sent in the
standard-network phase (`bnn_init_rounds`) are averaged on both moments, as the extractor's.
Point libraries have `sigmas` None and are unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.data.labels import MAX_LABELS
from edgefcl.federation.label_rows import MAX_COUNT, SIGMA_MIN, LabelRows, check_rows
from edgefcl.federation.messages import Update
from edgefcl.federation.robust import label_room
from edgefcl.federation.row_clip import clip_rows
from edgefcl.federation.share_cap import capped_columns, capped_groups, default_cap
from edgefcl.federation.sigma_bounds import (
    LIK_FLOOR,
    median_floor,
    precision_capped,
    sigma_ceiling,
)
from edgefcl.federation.value_bound import MAX_VALUE


def feature_width(tensors: dict[str, np.ndarray]) -> int:
    """Row width (d + 1) of the prototype library of an extractor, read from its global
    tensors: d is the output size of its last layer with a weight matrix or kernel (the last
    tensor of two or more dimensions in state order; MLP, CNN and ResNet extractors, dense or
    Gaussian). The aggregator daemon uses it when it starts from saved tensors."""
    mats = [t for t in tensors.values() if np.ndim(t) >= 2]
    if not mats:
        raise ValueError("no weight matrix in the initial tensors: cannot size the prototypes")
    return int(np.shape(mats[-1])[0]) + 1


class PrototypeRows:
    """The federation rule of the prototype head's library: its first library, the check of
    a device's library against the global's, and each round's library."""

    @staticmethod
    def width(tensors: dict[str, np.ndarray]) -> int:
        """Row width of an extractor's library, read from its tensors (`feature_width`)."""
        return feature_width(tensors)

    @staticmethod
    def initial(tensors: dict[str, np.ndarray], gaussian: bool) -> LabelRows:
        """The first global library of a run: empty, of the extractor's row width (Gaussian
        rows for a Bayesian encoding)."""
        return LabelRows.empty(feature_width(tensors), gaussian)

    @staticmethod
    def check(sent: LabelRows | None, held: LabelRows | None) -> str | None:
        """Why an update's library is refused (None: accepted): it must pass `check_rows` at
        the global's row width and be Gaussian exactly where the global's is; none where the
        run holds no library."""
        if sent is None:
            return None
        if held is None:
            return "prototypes"
        reason = check_rows(sent, held.width)
        if reason is None and sent.gaussian != held.gaussian:
            return "prototype_sigma"
        return reason

    @staticmethod
    def fold(updates: Sequence[Update], previous: LabelRows, owners: dict[str, str],
             fed: FedConfig, label_cap: int, counters: Counter,
             by_likelihood: bool = False, prior_sigma: float | None = None,
             combine: Callable[[np.ndarray], np.ndarray] | None = None
             ) -> tuple[LabelRows, dict[str, str]]:
        """The round's library and label owners: the new labels admitted by `label_room`
        (`label_cap` devices share its slots), then `average_tables` of the rows sent.
        `by_likelihood` (Gaussian rows under the fedbnn rule): updates of the standard-network
        phase (base version below `fed.bnn_init_rounds`) average, later ones multiply."""
        sent = [u for u in updates if u.prototypes is not None]
        tables, owners = label_room.admit(
            [u.prototypes for u in sent], [u.client for u in sent],  # type: ignore[misc]
            previous, owners, label_room.quota(fed, label_cap), counters)
        likelihood = ([u.base_version >= fed.bnn_init_rounds for u in sent]
                      if by_likelihood else None)
        return average_tables(tables, previous, fed.mix, fed.max_share, counters,
                              fed.sigma_floor, likelihood, prior_sigma, fed.clip_factor,
                              combine), owners


def average_tables(tables: Sequence[LabelRows], previous: LabelRows,
                   mix_weight: float, max_share: float = 1.0,
                   counters: Counter | None = None,
                   sigma_floor: float = 0.0,
                   likelihood: Sequence[bool] | None = None,
                   prior_sigma: float | None = None,
                   clip_factor: float = 0.0,
                   combine: Callable[[np.ndarray], np.ndarray] | None = None
                   ) -> LabelRows:
    """The next global library: per label, the sample-weighted mean of the rows sent (labels
    with zero samples in this round weigh equally), mixed `mix_weight : 1 - mix_weight` with the
    previous global's row where the label already had one; labels nobody sent keep their row.
    Per label, the rows' sample weights are share-capped first (`robust.share.capped_groups`:
    `max_share`, 0 = twice an equal share of the label's senders, >= 1 off; the global counts
    the capped weights; `counters["prototype_share_capped"]` counts capped rows).
    A Gaussian library (`previous.sigmas` set; every table sent must be Gaussian) combines the
    rows with `combine_gaussian` (sigma floor `sigma_floor`, precision cap `max_share`) and
    mixes on both moments.
    Rows (not likelihoods) are first clipped towards their label's median row and
    norm-clipped against the previous global's rows by `row_clip.clip_rows` (`clip_factor`
    x the median distance and the median sender's change; 0: off).
    `likelihood` (fedbnn rule; Gaussian libraries only), one flag per table: True for a table
    of row likelihoods (posterior / prior). A round with likelihoods combines only those, by
    `product_gaussian` against the previous global's row, or N(0, `prior_sigma`) for a new
    label (tables without the flag are left out, `counters["prototype_snn_ignored"]`); a round
    without any averages the rows' means and sigmas by their share-capped sample weights (the
    standard-network phase, as `gaussian.FedBNNProduct`).
    `combine` (point libraries; the robust rules' estimator, `Strategy.row_combiner`): each
    label's row is `combine` of its senders' rows (stack (senders, width)) instead of their
    weighted mean: a coordinate-wise median ignores a minority of senders whatever they claim.
    Labels keep the previous order, new ones follow in sorted order (deterministic); past
    MAX_LABELS the newest are left out."""
    flags = [False] * len(tables) if likelihood is None else [bool(f) for f in likelihood]
    if len(flags) != len(tables):
        raise ValueError("one likelihood flag per table")
    sent = [t for t in tables if t.labels]
    sent_flags = [f for t, f in zip(tables, flags, strict=True) if t.labels]
    if not sent:
        return previous
    gaussian = previous.sigmas is not None
    if gaussian and any(t.sigmas is None for t in sent):
        raise ValueError("a point prototype table in a Gaussian library's round")
    product = average = False  # fedbnn's two phases (likelihood given); else conflation
    if likelihood is not None:
        if not gaussian:
            raise ValueError("likelihood rows in a point library's round")
        product, average = any(sent_flags), not any(sent_flags)
        if product:
            if prior_sigma is None or not prior_sigma > 0:
                raise ValueError("the fedbnn rows need the prior sigma of a new label")
            if counters is not None and not all(sent_flags):
                counters["prototype_snn_ignored"] += sum(1 for f in sent_flags if not f)
            sent = [t for t, f in zip(sent, sent_flags, strict=True) if f]
    labels = [s for t in sent for s in t.labels]
    rows = np.concatenate([t.rows for t in sent]).astype(np.float64)
    counts = np.concatenate([t.counts for t in sent]).astype(np.float64)
    names = sorted(set(labels))  # the names as sent: never through a numpy string array
    at_name = {n: i for i, n in enumerate(names)}
    inverse = np.array([at_name[s] for s in labels], dtype=np.int64)
    old = previous.row_of()
    if not product:  # likelihood rows are not rows of the label: the sigma rules bound them
        base = np.zeros_like(rows)
        prev_at = np.array([old.get(s, -1) for s in labels], dtype=np.int64)
        base[prev_at >= 0] = previous.rows[prev_at[prev_at >= 0]]
        sender = np.repeat(np.arange(len(sent)), [len(t.labels) for t in sent])
        rows = clip_rows(rows, base, sender, clip_factor, counters, previous.rows, inverse)
    capped = capped_groups(counts, inverse, max_share)
    if counters is not None:
        counters["prototype_share_capped"] += int((capped < counts).sum())
    counts = capped
    weight = np.bincount(inverse, weights=counts, minlength=len(names))
    equal = weight[inverse] <= 0  # a label nobody counted: plain mean of its rows
    w = np.where(equal, 1.0, counts)
    if product:
        sigmas = np.concatenate([t.sigmas for t in sent]).astype(np.float64)  # type: ignore
        prior_mu = np.zeros((len(names), rows.shape[1]))
        prior_s = np.full_like(prior_mu, float(prior_sigma))  # type: ignore[arg-type]
        known = [(g, old[str(n)]) for g, n in enumerate(names) if str(n) in old]
        if known:
            g_at, p_at = (np.array(v) for v in zip(*known, strict=True))
            prior_mu[g_at] = previous.rows[p_at]
            prior_s[g_at] = previous.sigmas[p_at]  # type: ignore[index]
        mean, sigma = product_gaussian(rows, sigmas, inverse, len(names), prior_mu, prior_s,
                                       sigma_floor, counters, max_share, clip_factor)
    elif gaussian:
        sigmas = np.concatenate([t.sigmas for t in sent]).astype(np.float64)  # type: ignore
        if average:
            mean, sigma = _weighted_mean(rows, w, inverse, len(names)), _weighted_mean(
                sigmas, w, inverse, len(names))
        else:
            mean, sigma = combine_gaussian(rows, sigmas, w, inverse, len(names), sigma_floor,
                                           counters, max_share, clip_factor)
    elif combine is not None:
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse, minlength=len(names)))[:-1]
        mean = np.stack([combine(group) for group in np.split(rows[order], bounds)])
    else:
        mean = _weighted_mean(rows, w, inverse, len(names))
    out_labels = list(previous.labels) + [str(n) for n in names if n not in old]
    new_rows = np.zeros((len(out_labels) - len(old), rows.shape[1]))
    out_rows = np.concatenate([previous.rows.astype(np.float64), new_rows])
    out_counts = np.concatenate([previous.counts.astype(np.int64),
                                 np.zeros(len(out_labels) - len(old), np.int64)])
    index = {n: i for i, n in enumerate(out_labels)}
    at = np.array([index[str(n)] for n in names])  # one lookup per label, not per sample
    had = np.array([str(n) in old for n in names])
    out_sigmas = None
    if gaussian:
        out_sigmas = np.concatenate([previous.sigmas.astype(np.float64),  # type: ignore
                                     np.ones_like(new_rows)])
        mu_mix, s_mix = _mix_gaussian(mean, sigma, out_rows[at], out_sigmas[at], mix_weight)
        out_rows[at] = np.where(had[:, None], mu_mix, mean)
        # within what devices accept: a mixture of rows 2e6 apart has a sigma above 1e6
        out_sigmas[at] = np.clip(np.where(had[:, None], s_mix, sigma), SIGMA_MIN, MAX_VALUE)
    else:
        out_rows[at] = np.where(had[:, None],
                                mix_weight * mean + (1 - mix_weight) * out_rows[at], mean)
    added = np.rint(np.minimum(weight, MAX_COUNT))  # capped weights need not be whole
    out_counts[at] = np.minimum(out_counts[at] + added, MAX_COUNT).astype(np.int64)
    keep = min(len(out_labels), MAX_LABELS)  # the global stays within what devices accept
    return LabelRows(tuple(out_labels[:keep]), out_rows[:keep].astype(np.float32),
                     out_counts[:keep],
                     None if out_sigmas is None else out_sigmas[:keep].astype(np.float32))


def combine_gaussian(mu: np.ndarray, sigma: np.ndarray, weight: np.ndarray,
                     groups: np.ndarray, n_groups: int, sigma_floor: float = 0.0,
                     counters: Counter | None = None, max_share: float = 1.0,
                     clip_factor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per group (label), the sample-weighted conflation of its rows N(mu_k, sigma_k^2):
    precision = sum_k r_k / sigma_k^2, mean = sum_k (r_k / sigma_k^2) mu_k / precision, with
    r_k = weight_k * n / sum_j weight_j over the group's n senders (equal weights: r = 1, plain
    conflation, VFCL Eq. 11). First, in groups of two senders or more, every sigma is lowered
    to at most `clip_factor` x the group's median sigma of that entry (three senders or more;
    0: off), raised to at least `sigma_floor` x that median, and then no sender's
    precision r_k / sigma_k^2 may be over `max_share` of the entry's total (0: `default_cap`
    of the group's senders; >= 1: off), as `robust/sigma_floor.py` bounds the extractor's:
    a sender cannot take the row with a tiny sigma (`counters["prototype_sigma_floored"]`,
    `["prototype_sigma_share_capped"]` count the entries). Returns (mean, sigma) per group,
    float64."""
    mu = np.asarray(mu, np.float64)
    size = np.bincount(groups, minlength=n_groups)
    sigma = _floor_by_group(sigma, groups, size, sigma_floor, clip_factor, counters,
                            informative_only=False)
    total = np.bincount(groups, weights=weight, minlength=n_groups)
    r = weight * size[groups] / total[groups]
    prec_k = _capped_by_group(r[:, None] / np.square(sigma), groups, size, max_share,
                              capped_columns, counters)
    prec = np.zeros((n_groups, mu.shape[1]))
    eta = np.zeros_like(prec)
    np.add.at(prec, groups, prec_k)
    np.add.at(eta, groups, prec_k * mu)
    return eta / prec, 1.0 / np.sqrt(prec)


def product_gaussian(m: np.ndarray, sigma: np.ndarray, groups: np.ndarray, n_groups: int,
                     prior_mu: np.ndarray, prior_sigma: np.ndarray, sigma_floor: float = 0.0,
                     counters: Counter | None = None, max_share: float = 1.0,
                     clip_factor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """FedBNN Eq. 9 per group (label): the prior N(prior_mu, prior_sigma^2) of the group times
    its senders' likelihoods N(m_k, sigma_k^2), in natural parameters:
    precision = 1/prior_sigma^2 + sum_k lambda_k, mean = (prior_mu/prior_sigma^2
    + sum_k lambda_k m_k) / precision, lambda_k = max(1/sigma_k^2, LIK_FLOOR) (entries at or
    below the floor, sent as LIK_SIGMA_MAX for no information, are clamped and counted in
    `counters["prototype_fedbnn_clamped"]` of `["prototype_fedbnn_entries"]`). First, in groups
    of two senders or more, every informative likelihood sigma (< LIK_SIGMA_MAX) is lowered to
    at most `clip_factor` x the median of that entry over the group's informative likelihoods
    (three senders or more), raised to at least `sigma_floor` x that median, or x the
    senders' typical sigma where one alone informs it, and then no likelihood's precision may
    be over `max_share` of the entry's informative total (0: `default_cap`; >= 1: off), as
    `robust/sigma_floor.py` bounds the extractor's: one sender cannot take the row with a tiny
    sigma (`counters["prototype_sigma_floored"]`, `["prototype_sigma_share_capped"]`). Every
    likelihood counts once, whatever its sender's sample count (the likelihood already carries
    it). Returns (mean, sigma), float64."""
    m = np.asarray(m, np.float64)
    size = np.bincount(groups, minlength=n_groups)
    sigma = _floor_by_group(sigma, groups, size, sigma_floor, clip_factor, counters,
                            informative_only=True)
    lam = 1.0 / np.square(_capped_by_group(sigma, groups, size, max_share, precision_capped,
                                           counters))
    low = lam <= LIK_FLOOR * (1 + 1e-6)
    if counters is not None:
        counters["prototype_fedbnn_clamped"] += int(low.sum())
        counters["prototype_fedbnn_entries"] += int(lam.size)
    lam = np.maximum(lam, LIK_FLOOR)
    p_prior = 1.0 / np.square(np.asarray(prior_sigma, np.float64))
    prec = p_prior.copy()
    eta = p_prior * np.asarray(prior_mu, np.float64)
    np.add.at(prec, groups, lam)
    np.add.at(eta, groups, lam * m)
    return eta / prec, 1.0 / np.sqrt(prec)


def _floor_by_group(sigma: np.ndarray, groups: np.ndarray, size: np.ndarray, factor: float,
                    ceiling: float, counters: Counter | None, informative_only: bool
                    ) -> np.ndarray:
    """A float64 copy of `sigma` (rows), at least 1e-30, where, in every group (label) of two
    rows or more, each entry is lowered to at most `sigma_ceiling` (`ceiling` x the group's
    median, in groups of three or more: a wide sigma cannot raise the others' floor and,
    through the cap, lower their precision to its own; 0: off; of two senders neither can be
    the reference, and the smaller may be a tiny attacker's) and then raised to at least
    `median_floor` of the group's rows (`counters["prototype_sigma_ceiled"]`,
    `["prototype_sigma_floored"]` count the entries)."""
    sigma = np.maximum(np.asarray(sigma, np.float64), 1e-30)
    if factor <= 0 and ceiling <= 0:
        return sigma
    for members in _labels_of_two(groups, size):
        rows = sigma[members]
        if ceiling > 0 and len(members) >= 3:  # of two, the smaller may be a tiny attacker's
            top = np.minimum(rows, sigma_ceiling(rows, ceiling, informative_only))
            if counters is not None:
                counters["prototype_sigma_ceiled"] += int((top < rows).sum())
            rows = top
        if factor > 0:
            floor = median_floor(rows, factor, informative_only)
            if counters is not None:
                counters["prototype_sigma_floored"] += int((rows < floor).sum())
            rows = np.maximum(rows, floor)
        sigma[members] = rows
    return sigma


def _labels_of_two(groups: np.ndarray, size: np.ndarray) -> list[np.ndarray]:
    """The rows of each label sent by two senders or more (`size`: rows per label)."""
    rows = np.split(np.argsort(groups, kind="stable"), np.cumsum(size)[:-1])
    return [r for r in rows if len(r) >= 2]


def _capped_by_group(values: np.ndarray, groups: np.ndarray, size: np.ndarray,
                     max_share: float, cap: Callable[[np.ndarray, float], np.ndarray],
                     counters: Counter | None) -> np.ndarray:
    """`values` (rows: precisions, or sigmas) with `cap(members' rows, share)` applied in every
    group of two rows or more (`max_share`; 0: `default_cap` of the group's rows; >= 1: as
    they are); `counters["prototype_sigma_share_capped"]` counts the entries it changed."""
    if max_share >= 1:
        return values
    out = values.copy()
    for members in _labels_of_two(groups, size):
        out[members] = cap(values[members], max_share or default_cap(len(members)))
    if counters is not None:
        counters["prototype_sigma_share_capped"] += int((out != values).sum())
    return out


def _weighted_mean(x: np.ndarray, w: np.ndarray, groups: np.ndarray,
                   n_groups: int) -> np.ndarray:
    """Per group, the mean of the rows `x` weighted by `w` (> 0 in every group)."""
    sums = np.zeros((n_groups, x.shape[1]))
    np.add.at(sums, groups, w[:, None] * x)
    return sums / np.bincount(groups, weights=w, minlength=n_groups)[:, None]


def _mix_gaussian(mu_new: np.ndarray, s_new: np.ndarray, mu_prev: np.ndarray,
                  s_prev: np.ndarray, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Moment-matched mixture weight N(new) + (1 - weight) N(prev), as
    `federation.gaussian.mix_gaussian` (not imported: that module imports this one's users)."""
    mu = weight * mu_new + (1.0 - weight) * mu_prev
    var = (weight * np.square(s_new) + (1.0 - weight) * np.square(s_prev)
           + weight * (1.0 - weight) * np.square(mu_new - mu_prev))
    return mu, np.sqrt(var)
