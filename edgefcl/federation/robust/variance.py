"""BatchNorm statistics: a variance must be positive and finite, or every prediction of every
device that adopts it becomes NaN."""

from __future__ import annotations

import numpy as np

from edgefcl.federation.messages import Tensors

VARIANCE_SUFFIX = "running_var"


def check_variances(tensors: Tensors) -> str | None:
    """"variance" if a `*running_var` tensor holds a value <= 0 (or not finite), else None."""
    for k, t in tensors.items():
        if k.endswith(VARIANCE_SUFFIX) and not (np.isfinite(t).all() and (t > 0).all()):
            return "variance"
    return None
