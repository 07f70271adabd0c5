"""ONNX export of the learners' models, for the on-device predictor (`edgefcl export`).

Export runs in eval mode (BatchNorm uses its running statistics) with a dynamic batch axis,
an example batch of 2 and the whole model in one file (no external-data sidecar), so the file
can travel in one MQTT message and be served by `edgefcl.ondevice` without torch.

Exporter: "torchscript" (the default) traces the model with the legacy TorchScript exporter
(`dynamo=False`): for these feed-forward models it gives the same logits as the dynamo exporter
(both within 1e-6 of torch) and exports in 10-150 ms instead of 3-10 s, which matters because a
client re-exports after every global model. "dynamo" (torch.export + onnxscript) is the
exporter PyTorch develops further; pick it with `exporter="dynamo"` / `--exporter dynamo`.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from edgefcl.config import ConfigError, FedConfig, LearnConfig
from edgefcl.data.types import DataError
from edgefcl.federation.label_rows import ROWS_KEY
from edgefcl.learn.model_heads import head_of, library_model_head
from edgefcl.learn.models import build_model, eval_mode, model_device, resolve_model_name
from edgefcl.learn.params import get_tensors, set_tensors
from edgefcl.learn.variational import client_hooks
from edgefcl.learn.views import ClientView
from edgefcl.ondevice import OnnxModel
from edgefcl.support.statefiles import atomic_write, load_json, load_tensors

if TYPE_CHECKING:
    from edgefcl.federation.messages import GlobalModel, Tensors

EXPORTERS = ("torchscript", "dynamo")
INPUT_NAME = "x"
OUTPUT_NAME = "logits"
OPSET = 17
EXAMPLE_BATCH = 2
GLOBAL_FILE = "global.npz"
"""The final global model in a run directory (written by `edgefcl simulate --out`)."""
PROTOTYPE_ROWS = ROWS_KEY
"""global.npz entry of a prototype-library run: the library's rows, in results.json's labels
order (the classifier of the exported model)."""


def with_labels(data: bytes, labels: list[str]) -> bytes:
    """The ONNX model `data` with the class labels in its metadata (`labels`: a JSON list, the
    name of class c at index c), read back by `edgefcl predict`."""
    import json

    import onnx

    proto = onnx.load_from_string(data)
    entry = next((p for p in proto.metadata_props if p.key == "labels"), None)
    if entry is None:
        entry = proto.metadata_props.add()
        entry.key = "labels"
    entry.value = json.dumps([str(v) for v in labels])
    return proto.SerializeToString()


def export_onnx(model: nn.Module, sample_shape: tuple[int, ...], path: str | Path | None = None,
                exporter: str = "torchscript", named_weights: bool = False) -> bytes:
    """Serialize `model` (in eval mode) as ONNX: input "x" of shape (batch, *sample_shape),
    output "logits" (batch, C), dynamic batch axis, one self-contained file.

    Writes the bytes atomically to `path` when given and returns them. The model's train/eval
    modes are restored afterwards. `named_weights` (torchscript exporter) skips constant folding,
    so that the weights stay initializers named as in the model's state_dict (BatchNorm not
    folded into the convolutions): `OnnxTemplate.with_weights` can then refill them.
    """
    if exporter not in EXPORTERS:
        raise ConfigError(f"unknown exporter '{exporter}'; choose from {', '.join(EXPORTERS)}")
    shape = tuple(int(s) for s in sample_shape)
    if not shape or any(s < 1 for s in shape):
        raise DataError(f"sample_shape must be non-empty with positive sizes, got {shape}")
    example = torch.zeros((EXAMPLE_BATCH, *shape), device=model_device(model))
    with eval_mode(model), warnings.catch_warnings(), _quiet_onnx_logs():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape reads in forward
        if exporter == "torchscript":
            buf = io.BytesIO()
            torch.onnx.export(model, (example,), buf, dynamo=False, opset_version=OPSET,
                              do_constant_folding=not named_weights,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
            data = buf.getvalue()
        else:
            program = torch.onnx.export(
                model, (example,), dynamo=True, external_data=False, verbose=False,
                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                dynamic_shapes={INPUT_NAME: {0: torch.export.Dim("batch")}})
            data = program.model_proto.SerializeToString()
    if path is not None:
        atomic_write(Path(path), data)
    return data


class _quiet_onnx_logs:
    """Silence the exporter's logger warnings (e.g. 'torchvision is not installed') while
    exporting."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("torch.onnx")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


def max_logit_diff(model: nn.Module, onnx_bytes: bytes, x: np.ndarray) -> float:
    """Largest |torch logit - onnxruntime logit| of `model` and its export on inputs x."""
    with eval_mode(model), torch.no_grad():
        ref = model(torch.from_numpy(np.asarray(x, np.float32)).to(model_device(model)))
    got = OnnxModel(onnx_bytes).logits(x)
    return float(np.abs(ref.float().cpu().numpy() - got).max())


# -- run directories ------------------------------------------------------------------------
def architecture_spec(model: str, sample_shape: tuple[int, ...], n_classes: int,
               hidden: int) -> dict[str, Any]:
    """What rebuilds a run's architecture: the concrete model name, sample shape, classes and
    MLP width (stored as "model_spec" in results.json)."""
    shape = tuple(int(s) for s in sample_shape)
    return {"model": resolve_model_name(model, shape), "sample_shape": list(shape),
            "n_classes": int(n_classes), "hidden": int(hidden)}


def load_run_model(run: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The final global model of a run directory written by `edgefcl simulate --out DIR`
    (results.json with "model_spec" and "config", and global.npz), and its spec."""
    run = Path(run)
    results_path = run / "results.json"
    if not results_path.is_file():
        raise DataError(f"{run} is not a run directory (no results.json); an aggregator state "
                        "directory has one once every client is done")
    results = load_json(results_path)
    global_path = run / results.get("global_file", GLOBAL_FILE)
    if "runs" in results:
        raise DataError(f"{run} holds several runs; pass one of them, e.g. "
                        f"{run}/{results['runs'][0]['method']}/seed{results['runs'][0]['seed']}")
    if "model_spec" not in results or not global_path.is_file():
        raise DataError(f"{run} has no saved global model (model_spec in results.json and "
                        f"{GLOBAL_FILE}); rerun `edgefcl simulate --out {run}`")
    spec = results["model_spec"]
    config = results.get("config", {})
    learn, fed = (_section(cls, config.get(name, {}))
                  for cls, name in ((LearnConfig, "learn"), (FedConfig, "fed")))
    model = build_model(spec["model"], tuple(spec["sample_shape"]), spec["n_classes"],
                        spec["hidden"])
    tensors = load_tensors(global_path)
    rows = tensors.pop(PROTOTYPE_ROWS, None)
    if rows is not None:  # head prototypes: extractor + the global library as classifier
        model = library_model_head().wrap(model)
    model = client_hooks(learn.method, learn, fed).prepare_model(model)  # e.g. Bayesian layers
    state = model.state_dict()
    bad = sorted(set(tensors) - set(state)) + [
        k for k, v in tensors.items() if k in state and tuple(v.shape) != tuple(state[k].shape)]
    if bad:
        raise DataError(f"{global_path} does not fit the {spec['model']} model of the run "
                        f"(unknown or mis-shaped tensors: {bad[:5]})")
    set_tensors(model, tensors)
    if rows is not None:
        head_of(model).load_rows(model, [str(n) for n in results.get("labels") or
                                         range(len(rows))], rows)
    return model.eval(), spec


def _section(cls: type, values: dict[str, Any]) -> Any:
    """A config section from a results.json dict (keys this version does not know are
    ignored)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def export_run(run: str | Path, output: str | Path | None = None,
               exporter: str = "torchscript", check_samples: int = 7) -> dict[str, Any]:
    """Export the final global model of run directory `run` to `output` (default
    RUN/model.onnx). Checks the export against torch on `check_samples` random inputs in
    [0, 1) and returns {"path", "bytes", "exporter", "model", "max_abs_diff"}."""
    model, spec = load_run_model(run)
    path = Path(output) if output else Path(run) / "model.onnx"
    if not path.parent.is_dir():
        raise ConfigError(f"--output: folder {path.parent} does not exist")
    data = export_onnx(model, tuple(spec["sample_shape"]), None, exporter)
    labels = load_json(Path(run) / "results.json").get("labels") or \
        [str(c) for c in range(spec["n_classes"])]
    data = with_labels(data, labels)
    atomic_write(path, data)
    x = np.random.default_rng(0).random((check_samples, *spec["sample_shape"]), np.float32)
    return {"path": str(path), "bytes": len(data), "exporter": exporter,
            "model": spec["model"], "max_abs_diff": max_logit_diff(model, data, x),
            "labels": labels}


def global_state(client: ClientView, g: GlobalModel) -> Tensors:
    """The model state a client would load from global `g` (decoded by its encoder), without
    touching the client: what `edgefcl simulate --out` saves as global.npz."""
    model = copy.deepcopy(client.model)
    set_tensors(model, client.encoder.decode_global(g.tensors, get_tensors(model)))
    state = get_tensors(model)
    if g.prototypes is not None:  # the global library, in g.prototypes.labels order
        state[PROTOTYPE_ROWS] = np.array(g.prototypes.rows, np.float32)
    return state
