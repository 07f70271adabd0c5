"""The outcome of a run (RunResult) and the config dict it records: below simulate and the fleet
runtime, which both produce results, and report, which reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgefcl.config import RunConfig, to_dict
from edgefcl.outcomes.metrics import CommStats, forgetting, last_accuracy


@dataclass
class RunResult:
    """Outcome of one run (one method, one seed)."""

    method: str
    """The method, or the `--compare` entry the run was made for ("bi+sparse")."""
    seed: int
    acc: np.ndarray
    """Accuracy matrix `acc[client][after task t][task i]`, fractions in [0, 1] (K, T, T)."""
    rounds: int
    """Rounds the aggregator closed (0: the clients trained alone)."""
    comm: CommStats
    """Bytes up and down, per client and per round (`comm.bytes_up`, `comm.bytes_down`)."""
    global_sha256: str
    """sha256 over the final global's tensors, sorted by name: the same seed, the same hash."""
    config: dict
    """The run's whole configuration, with its method and seed."""
    wall_s: float
    """Seconds the run took."""
    extra: dict = field(default_factory=dict)
    """What else results.json holds (timings, prequential accuracy, environment, ...)."""
    global_state: dict | None = None
    """The final global as model tensors (saved as global.npz; None when read back)."""

    @property
    def accuracy(self) -> float:
        """A, %: the accuracy on every task after the last one, mean over clients."""
        return 100.0 * last_accuracy(self.acc)

    @property
    def forgetting(self) -> float:
        """F, %: how far each task but the last fell from its best before the end, mean
        over those tasks and the clients."""
        return 100.0 * forgetting(self.acc)

    def to_dict(self) -> dict:
        """What results.json holds (the matrix in %)."""
        return {"method": self.method, "seed": self.seed, "accuracy": self.accuracy,
                "forgetting": self.forgetting,
                "accuracy_matrix": np.round(100.0 * self.acc, 4).tolist(),
                "rounds": self.rounds, **self.comm.to_dict(),
                "global_sha256": self.global_sha256, "wall_s": round(self.wall_s, 3),
                "config": self.config, **self.extra}


def cfg_dict(cfg: RunConfig, method: str, seed: int) -> dict:
    """The run's config as a dict, with the method and seed actually used."""
    d = to_dict(cfg)
    d["learn"]["method"] = method
    d["seed"] = seed
    return d
