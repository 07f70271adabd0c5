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
    seed: int
    acc: np.ndarray  # (K, T, T) fractions
    rounds: int
    comm: CommStats
    global_sha256: str
    config: dict
    wall_s: float
    extra: dict = field(default_factory=dict)
    global_state: dict | None = None  # final global as model tensors (saved as global.npz)

    @property
    def accuracy(self) -> float:
        return 100.0 * last_accuracy(self.acc)

    @property
    def forgetting(self) -> float:
        return 100.0 * forgetting(self.acc)

    def to_dict(self) -> dict:
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
