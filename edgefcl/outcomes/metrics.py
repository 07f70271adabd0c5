"""Continual-learning metrics (paper appendix A.5) and communication totals."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def last_accuracy(acc: np.ndarray) -> float:
    """A: mean over clients of the mean accuracy on every task after the last task.

    `acc` has shape (K, T, T): acc[k, t, i] = accuracy of client k on task i after task t.
    """
    acc = np.asarray(acc, np.float64)
    return float(acc[:, -1, :].mean())


def forgetting(acc: np.ndarray) -> float:
    """F: mean over clients and tasks j < T of max_{l < T} acc[k, l, j] - acc[k, T, j]."""
    acc = np.asarray(acc, np.float64)
    if acc.shape[1] < 2:
        return 0.0
    best = acc[:, :-1, :-1].max(axis=1)
    return float((best - acc[:, -1, :-1]).mean())


def sample_std(values) -> float | None:
    """Sample standard deviation (ddof=1), what every printed ± means; None for fewer than
    two values, where it is undefined (tables then print the mean alone, JSON null)."""
    v = np.asarray(values, np.float64)
    return float(v.std(ddof=1)) if v.size > 1 else None


def pm(mean: float, std: float | None, spec: str = ".1f") -> str:
    """`mean ± std` as tables print it (`spec` formats both; a `+` in it signs the mean
    only); the mean alone when `std` is None (one seed)."""
    return f"{mean:{spec}}" if std is None else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


def or_zero(std: float | None) -> float:
    """`std` as an error bar's length: 0 (none drawn) when undefined."""
    return 0.0 if std is None else std


def per_task_final(acc: np.ndarray) -> np.ndarray:
    """Accuracy on each task after the last task, averaged over clients (T,)."""
    return np.asarray(acc, np.float64)[:, -1, :].mean(axis=0)


def label_coverage(coverage: np.ndarray, prototypes: bool) -> dict:
    """Result fields of a prototype-head run (none for a fixed head): `known_labels[k][t]`,
    the labels device k's library knew when it evaluated after task t (the accuracy matrix
    row t is over those labels), and `unknown_label_test_samples[k][t]`, the test samples
    (all tasks) whose label it did not know then, counted wrong."""
    if not prototypes:
        return {}
    return {"known_labels": coverage[0].tolist(), "unknown_label_test_samples":
            coverage[1].tolist()}


@dataclass
class CommStats:
    """Bytes each client sent and received, per client and per round."""

    up: dict[str, int] = field(default_factory=dict)
    down: dict[str, int] = field(default_factory=dict)
    per_round_up: list[int] = field(default_factory=list)
    per_round_down: list[int] = field(default_factory=list)

    def sent(self, client: str, n: int) -> None:
        self.up[client] = self.up.get(client, 0) + n

    def received(self, client: str, n: int) -> None:
        self.down[client] = self.down.get(client, 0) + n

    @property
    def bytes_up(self) -> int:
        return sum(self.up.values())

    @property
    def bytes_down(self) -> int:
        return sum(self.down.values())

    def to_dict(self) -> dict:
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "bytes_up_per_client": self.up, "bytes_down_per_client": self.down,
                "bytes_up_per_round": self.per_round_up,
                "bytes_down_per_round": self.per_round_down}
