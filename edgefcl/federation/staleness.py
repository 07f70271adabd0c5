"""Staleness rules (FedAsync, Xie et al. 2019): how much an update counts when the global it
was trained from is `tau` versions older than the one the round replaces. One class per rule;
`STALENESS` is the registry. A rule scales the update's weight within its round and the
round's mix with the previous global (`round_weights.weigh`), so a round of stale updates
moves the global less, as FedAsync's alpha_t = alpha * s(t - tau) does for a round of one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    """s(tau) = 1: every update counts fully (the lock-step paper's rule)."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, tau: int) -> float:
        return 1.0


@dataclass(frozen=True)
class Polynomial:
    """s(tau) = (1 + tau)^-a."""

    a: float = 0.5
    b: float = 0.0

    def __call__(self, tau: int) -> float:
        return float((1.0 + max(tau, 0)) ** -self.a)


@dataclass(frozen=True)
class Hinge:
    """s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1)."""

    a: float = 10.0
    b: float = 4.0

    def __call__(self, tau: int) -> float:
        return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)


STALENESS = {"constant": Constant, "polynomial": Polynomial, "hinge": Hinge}
"""Rule name -> class; built with the config's `staleness_a` and `staleness_b`."""


def staleness_rule(name: str, a: float, b: float) -> Constant | Polynomial | Hinge:
    """The rule `name` with parameters a, b; KeyError for an unknown name (config checks it)."""
    return STALENESS[name](a, b)
