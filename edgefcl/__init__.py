"""edgefcl: online federated continual learning on edge devices.

The Python API (`edgefcl.api`): `Learner` (river's learn_many / predict_many interface),
`simulate` (a whole fleet in process) and the configuration dataclasses. They load on first
use, so that `import edgefcl` stays light (a predicting device needs no torch).
"""

from __future__ import annotations

from typing import Any

from edgefcl.data import loaders as _loaders  # noqa: F401  (register the names and
from edgefcl.federation import heads as _heads  # noqa: F401  forms that configs are
from edgefcl.federation import registry as _encodings  # noqa: F401  checked against)
from edgefcl.learn import methods as _methods  # noqa: F401
from edgefcl.version import __version__

API = {
    "Learner": "edgefcl.api", "simulate": "edgefcl.api", "sweep": "edgefcl.api",
    "summarize": "edgefcl.api", "RunResult": "edgefcl.api",
    "RunConfig": "edgefcl.config", "DataConfig": "edgefcl.config",
    "LearnConfig": "edgefcl.config", "FedConfig": "edgefcl.config",
    "MqttConfig": "edgefcl.config", "ConfigError": "edgefcl.config",
}
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name not in API:
        raise AttributeError(f"module 'edgefcl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(API[name]), name)
