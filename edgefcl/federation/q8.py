"""The `q8` update encoding: 8-bit per-tensor affine quantisation of the dense update.

Each weight tensor `w` (2 or more axes) travels as `w::q8`, uint8 of the tensor's shape, and
`w::q8range`, float32 [lo, step]; its values are lo + q * step, with lo the tensor's minimum
and step = (max - min) / 255, so the rounding error of an entry is at most step / 2. Vectors
(biases, normalisation parameters and statistics, about 1% of a model) travel as float32, as in
the sparse encoding: a BatchNorm variance must stay exact and positive. The aggregator
validates the payload, dequantises it (`decode`) and aggregates the result with any dense rule
(fedavg, class-weighted, median, trimmed-mean); globals go back dense.
"""

from __future__ import annotations

import numpy as np

from edgefcl.federation.encodings import Encoding
from edgefcl.federation.messages import Tensors
from edgefcl.federation.rules import DENSE_RULES
from edgefcl.federation.strategy import Spec, check_tensor
from edgefcl.federation.value_bound import MAX_VALUE

CODES, RANGE = "::q8", "::q8range"
LEVELS = 255


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes of x's shape, float32 [lo, step]) of the finite float32 array `x`."""
    lo, hi = float(x.min()), float(x.max())
    step = np.float32((hi - lo) / LEVELS)
    q = np.rint((x.astype(np.float64) - lo) / float(step)) if step > 0 else np.zeros(x.shape)
    return np.clip(q, 0, LEVELS).astype(np.uint8), np.array([lo, step], np.float32)


def dequantize(q: np.ndarray, rng: np.ndarray) -> np.ndarray:
    """float32 values lo + q * step."""
    lo, step = (float(v) for v in rng)
    return (lo + q.astype(np.float64) * step).astype(np.float32)


class Q8Encoder:
    """Client encoder of `q8`: weight tensors quantised, vectors as they are (no state)."""

    name = "q8"

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        out: Tensors = {}
        for k, t in current.items():
            t = np.asarray(t, np.float32)
            if t.ndim < 2:
                out[k] = t
            else:
                out[k + CODES], out[k + RANGE] = quantize(t)
        return out

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        return tensors


def _spec_name(key: str, spec: Spec) -> str | None:
    """The spec tensor `key` carries: the name itself, or the name and exactly one of the
    suffixes (None for anything else, such as a name with both)."""
    if key in spec:
        return key
    for suffix in (CODES, RANGE):
        if key.endswith(suffix) and key[: -len(suffix)] in spec:
            return key[: -len(suffix)]
    return None


def check_q8(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject a q8 payload: every spec tensor exactly once, as float32 or as a
    uint8 code of its shape with a finite [lo, step >= 0] whose values stay within
    MAX_VALUE."""
    seen = set()
    for key, t in tensors.items():
        name = _spec_name(key, spec)
        if name is None:
            return "names"
        if key == name:
            reason = check_tensor(t, spec[name])
            if reason is not None:
                return reason
        elif key.endswith(CODES):
            if name + RANGE not in tensors or name in tensors:
                return "names"
            if t.dtype != np.uint8:
                return "dtype"
            if tuple(t.shape) != tuple(spec[name]):
                return "shape"
        else:
            if name + CODES not in tensors:
                return "names"
            if t.dtype != np.float32 or t.shape != (2,):
                return "shape" if t.dtype == np.float32 else "dtype"
            with np.errstate(over="ignore"):
                top = t[0] + np.float32(LEVELS) * t[1]
            if not (np.isfinite(t).all() and t[1] >= 0 and np.isfinite(top)):
                return "nonfinite"
            if max(abs(float(t[0])), abs(float(top))) > MAX_VALUE:
                return "range"
        seen.add(name)
    return None if seen == set(spec) else "names"


def decode_q8(tensors: Tensors) -> Tensors:
    """A validated q8 payload as dense float32 tensors."""
    out: Tensors = {}
    for key, t in tensors.items():
        if key.endswith(CODES):
            name = key[: -len(CODES)]
            out[name] = dequantize(t, tensors[name + RANGE])
        elif not key.endswith(RANGE):
            out[key] = t
    return out


Q8 = Encoding(
    name="q8",
    help="8-bit per-tensor affine quantisation of the dense update",
    make_encoder=lambda fed: Q8Encoder(),
    validate=check_q8,
    rules=DENSE_RULES,
    decode=decode_q8,
)
