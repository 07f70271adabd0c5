"""On-device inference: serve an exported ONNX model with onnxruntime.

This module imports only numpy and onnxruntime (never torch), so a device that only predicts
needs neither PyTorch nor its start-up cost. Models come from `edgefcl export` (a run's global
model) or from a client with `export_onnx` set (its live model after each global); they take
float32 inputs of shape (batch, *sample_shape) with a dynamic batch axis and return logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgefcl.data.types import DataError

DEFAULT_BATCH = 1024
"""Samples per onnxruntime call when predicting a large array."""


def session_options(threads: int = 1) -> ort.SessionOptions:
    """onnxruntime options with `threads` intra-op threads (1 keeps results reproducible and
    leaves the device's other cores to training)."""
    if threads < 1:
        raise DataError(f"threads must be >= 1, got {threads}")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3  # errors only
    # no memory arena: a session's first run would grow it (21 against 13 ms for 96 views of
    # the 28x28 CNN), and a client's scoring session lives for one global model; later runs
    # are as fast without it
    so.enable_cpu_mem_arena = False
    return so


class OnnxModel:
    """An ONNX classifier run by onnxruntime on the CPU.

    `source` is a path to a .onnx file or the model's serialized bytes. `sample_shape` is
    the input shape without the batch axis (None where the model leaves an axis dynamic).
    """

    def __init__(self, source: str | Path | bytes, threads: int = 1) -> None:
        if not isinstance(source, bytes):
            path = Path(source)
            if not path.is_file():
                raise DataError(f"ONNX model not found: {path}")
            source = path.read_bytes()
        try:
            self.session = ort.InferenceSession(source, session_options(threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types
            raise DataError(f"cannot load the ONNX model: {e}") from e
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise DataError(f"expected a model with one input, got {len(inputs)}")
        self.input_name: str = inputs[0].name
        dims = inputs[0].shape
        self.sample_shape: tuple[int | None, ...] = tuple(
            d if isinstance(d, int) else None for d in dims[1:])
        self.fixed_batch: int | None = dims[0] if isinstance(dims[0], int) else None
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self.labels: list[str] | None = [str(v) for v in json.loads(meta["labels"])]
        except (KeyError, ValueError, TypeError):
            self.labels = None

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise DataError(f"inputs must be numeric, got dtype {x.dtype}")
        want = self.sample_shape
        if x.ndim != len(want) + 1 or any(
                w is not None and s != w for s, w in zip(x.shape[1:], want, strict=True)):
            shown = tuple("?" if w is None else w for w in want)
            raise DataError(f"the model takes inputs of shape (batch, {', '.join(map(str, shown))})"
                            f", got an array of shape {x.shape}")
        if not np.isfinite(x).all():
            raise DataError("inputs contain NaN or Inf")
        return np.ascontiguousarray(x, dtype=np.float32)

    def logits(self, x: np.ndarray, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Logits (N, C) float32 for inputs x of shape (N, *sample_shape)."""
        x = self._check(x)
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if self.fixed_batch is not None and len(x) != self.fixed_batch:
            raise DataError(f"the model has a fixed batch of {self.fixed_batch} samples, got "
                            f"{len(x)}; export it with a dynamic batch axis (edgefcl export)")
        if len(x) <= batch_size:
            return self.session.run(None, {self.input_name: x})[0]
        parts = [self.session.run(None, {self.input_name: x[i:i + batch_size]})[0]
                 for i in range(0, len(x), batch_size)]
        return np.concatenate(parts)

    def predict(self, x: np.ndarray, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Predicted class (N,) int64: the argmax of the logits."""
        return self.logits(x, batch_size).argmax(axis=1).astype(np.int64)


def load_array(path: str | Path, what: str = "input") -> np.ndarray:
    """A .npy array (no pickles), with a clear error when it is missing or unreadable."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{what} file not found: {p}")
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"{p}: not a readable .npy array ({e})") from e


def predict_file(model: str | Path, inputs: str | Path, output: str | Path | None = None,
                 logits_out: str | Path | None = None, labels: str | Path | None = None,
                 threads: int = 1) -> dict[str, Any]:
    """Predict the classes of the .npy array `inputs` with the ONNX `model`.

    Writes the predictions (int64) to `output` and the logits (float32) to `logits_out` when
    given; with `labels` (.npy of int labels) also reports the accuracy. Returns a summary:
    samples, classes (predicted class -> count) and accuracy (None without labels).
    """
    m = OnnxModel(model, threads)
    x = load_array(inputs)
    z = m.logits(x)
    pred = z.argmax(axis=1).astype(np.int64)
    if output is not None:
        np.save(output, pred)
    if logits_out is not None:
        np.save(logits_out, z)
    accuracy = None
    if labels is not None:
        y = load_array(labels, "labels")
        if y.shape != pred.shape:
            raise DataError(f"labels have shape {y.shape}, predictions {pred.shape}")
        accuracy = float((pred == y).mean()) if len(y) else float("nan")
    classes, counts = np.unique(pred, return_counts=True)
    names = m.labels or []
    named = [names[c] if 0 <= c < len(names) else str(c) for c in classes.tolist()]
    return {"samples": int(len(pred)), "accuracy": accuracy,
            "classes": dict(zip(named, counts.tolist(), strict=True)), "labels": m.labels}
