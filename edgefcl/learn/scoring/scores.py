"""Uncertainty scores from test-time-augmented logits.

Every score takes a (P, N, C) logit tensor (P views, N samples, C classes) and returns a (N,)
float tensor. p_i = softmax(z_i) and pbar = mean_i p_i. The registry of scores is
`edgefcl.learn.methods.SCORES`; `uncertainty(name, logits)` computes one, larger always
meaning more uncertain.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from edgefcl.data.types import DataError
from edgefcl.learn.methods import get_score, load


def _checked(logits: Tensor, min_classes: int = 1) -> Tensor:
    """Validate a (P, N, C) logit tensor; compute in at least float32."""
    if logits.ndim != 3:
        raise DataError(
            "scores need logits of shape (P views, N samples, C classes), got "
            f"{tuple(logits.shape)}"
        )
    p, _, c = logits.shape
    if p < 1 or c < min_classes:
        raise DataError(
            f"scores need at least 1 view and {min_classes} classes, got logits of shape "
            f"{tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise DataError(f"logits must be floating point, got {logits.dtype}")
    return logits if logits.dtype == torch.float64 else logits.float()


def log_mean_probs(logits: Tensor) -> Tensor:
    """log pbar, shape (N, C): log of the mean over views of the softmax, computed stably."""
    z = _checked(logits)
    return torch.logsumexp(torch.log_softmax(z, dim=-1), dim=0) - math.log(z.shape[0])


def mean_probs(logits: Tensor) -> Tensor:
    """pbar = mean_i softmax(z_i), shape (N, C)."""
    return log_mean_probs(logits).exp()


def bregman_information(logits: Tensor) -> Tensor:
    """BI = mean_i LSE(z_i) - LSE(mean_i z_i), LSE over classes; >= 0 by Jensen (rounding
    below 0 is clamped). 0 when all views agree; unchanged by a constant added to all logits
    of one view of a sample."""
    z = _checked(logits)
    bi = torch.logsumexp(z, dim=-1).mean(dim=0) - torch.logsumexp(z.mean(dim=0), dim=-1)
    return bi.clamp_min(0.0)


def least_confidence(logits: Tensor) -> Tensor:
    """LC = 1 - max_c pbar(c)."""
    return 1.0 - mean_probs(logits).amax(dim=-1)


def _top2(logits: Tensor) -> tuple[Tensor, Tensor]:
    top = mean_probs(_checked(logits, min_classes=2)).topk(2, dim=-1).values
    return top[:, 0], top[:, 1]


def margin(logits: Tensor) -> Tensor:
    """MS = top1(pbar) - top2(pbar); a small margin means uncertain. Needs C >= 2."""
    top1, top2 = _top2(logits)
    return top1 - top2


def ratio(logits: Tensor) -> Tensor:
    """RC = top2(pbar) / top1(pbar), in [0, 1]; larger means uncertain. Needs C >= 2."""
    top1, top2 = _top2(logits)
    return top2 / top1


def entropy(logits: Tensor) -> Tensor:
    """EN = -sum_c pbar(c) log pbar(c)."""
    log_p = log_mean_probs(logits)
    return -(log_p.exp() * log_p).sum(dim=-1)


def agreement(logits: Tensor) -> Tensor:
    """1 - (votes of the most voted argmax class over the P views) / P; 0 when all agree."""
    z = _checked(logits)
    votes = torch.nn.functional.one_hot(z.argmax(dim=-1), z.shape[-1]).sum(dim=0)
    return 1.0 - votes.amax(dim=-1).to(z.dtype) / z.shape[0]


def one_minus_margin(logits: Tensor) -> Tensor:
    """1 - MS: larger means more uncertain (the memory's convention)."""
    return 1.0 - margin(logits)


_LOADED: dict[str, Callable[[Tensor], Tensor]] = {}


def uncertainty(name: str, logits: Tensor) -> Tensor:
    """The uncertainty of score `name` (`edgefcl.learn.methods.SCORES`) per sample, shape (N,);
    larger is more uncertain for every score ("ms" gives 1 - margin)."""
    fn = _LOADED.get(name)
    if fn is None:
        fn = _LOADED[name] = load(get_score(name).fn)
    return fn(logits)
