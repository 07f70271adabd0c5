"""Burn-in and jump: which mini-batches make a client take part in a communication round."""

from __future__ import annotations


def eligible(batch: int, burn_in: int, jump: int) -> bool:
    """True when a client that has seen `batch` mini-batches of its current task takes part.

    The paper's rule: b >= burn_in and b % q == 0, with b (`batch_in_task`) counted from 1
    and reset per task.
    """
    return batch >= max(burn_in, 1) and batch % jump == 0


def nth_eligible(n: int, burn_in: int, jump: int) -> int:
    """The mini-batch at which a client takes part for the n-th time (n >= 1) in a task."""
    return (-(-max(burn_in, 1) // jump) + max(n, 1) - 1) * jump
