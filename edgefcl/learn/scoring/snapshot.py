"""The client's scoring snapshot as onnxruntime runs it (`ClientOnnx`): the snapshot's graph
from an `OnnxTemplate` refilled with its weights, scored in this process or by the scoring
worker (`WorkerScores`); and the client's export of its live model after every global.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from edgefcl.config import ConfigError, LearnConfig, scores_with_onnxruntime
from edgefcl.data.types import DataError
from edgefcl.learn.export import export_onnx, with_labels
from edgefcl.learn.models import eval_mode, model_device
from edgefcl.learn.scoring.perturb import ImagePerturber, NoisePerturber, Perturber
from edgefcl.learn.scoring.scores import uncertainty
from edgefcl.learn.scoring.worker import PerturberSpec, WorkerError, shared_worker
from edgefcl.learn.views import LearnerView
from edgefcl.ondevice import OnnxModel
from edgefcl.support.statefiles import atomic_write

log = logging.getLogger(__name__)


class OnnxTemplate:
    """A model's architecture exported to ONNX once, refilled with weights by name.

    The export is of a copy of the model whose floating tensors hold distinct random values, so
    that the exporter keeps one initializer per state_dict entry, named as the entry (a fresh
    BatchNorm's equal weight and running variance would otherwise share one). `with_weights`
    writes a state's tensors over those initializers' bytes in a copy of the serialized graph
    (1.5-2 ms for a session from it, where an export takes 26-200 ms). The
    refilled graph is a plain ONNX file, so onnxruntime still folds BatchNorm into the
    convolutions when it loads it. A template may be shared by threads (`TemplateCache`).
    """

    def __init__(self, model: nn.Module, sample_shape: tuple[int, ...]) -> None:
        import onnx

        self._lock = threading.Lock()  # with_weights writes into the one graph

        twin = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for v in twin.state_dict().values():
                if v.is_floating_point():
                    v.copy_(0.5 + torch.rand(v.shape, generator=gen))
        self.proto = onnx.load_from_string(export_onnx(twin, sample_shape, named_weights=True))
        graph = self.proto.graph
        slots = {t.name: t for t in graph.initializer}
        state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        self._slots = {k: slots[k] for k in state if k in slots}
        # float tensors the graph holds that no state_dict entry refills: values the forward
        # reads from elsewhere (a prototype library's rows), baked in as the export saw them
        constants = [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute]
        baked = [t for t in [*graph.initializer, *constants] if t.name not in self._slots
                 and t.data_type != onnx.TensorProto.INT64 and math.prod(t.dims) > 1]
        self.complete = not baked and len(self._slots) == len(state) and all(
            tuple(t.dims) == tuple(state[k].shape) and t.data_type == onnx.TensorProto.FLOAT
            for k, t in self._slots.items())
        """Whether the model's state_dict holds every tensor of the graph (but scalars), each
        as the initializer of its name: only then does a refill give the model's logits."""
        self._spans = self._weight_spans() if self.complete else None

    def _weight_spans(self) -> tuple[bytes, dict[str, tuple[int, int]]] | None:
        """The serialized graph and where each slot's raw float32 bytes lie in it, when every
        slot's bytes occur there exactly once (the twin's random values make that near
        certain): a refill is then a copy of the graph with those byte ranges overwritten."""
        from onnx import numpy_helper

        for slot in self._slots.values():  # every weight as raw little-endian bytes
            values = numpy_helper.to_array(slot).astype("<f4")
            slot.ClearField("float_data")
            slot.raw_data = values.tobytes()
        data = self.proto.SerializeToString()
        spans = {}
        for name, slot in self._slots.items():
            start = data.find(slot.raw_data)
            if start < 0 or data.find(slot.raw_data, start + 1) >= 0:
                return None
            spans[name] = (start, len(slot.raw_data))
        return data, spans

    def with_weights(self, state: dict[str, Tensor]) -> bytes:
        """The ONNX graph with the float32 weights of `state` (a state_dict of the model).

        Overwrites the weights' byte ranges in a copy of the serialized graph: 0.07 ms for the
        small CNN, where setting the initializers and serializing took 0.27 ms, all of it
        holding the GIL that a training thread needs."""
        weights = {name: state[name].detach().to("cpu", torch.float32).contiguous().numpy()
                   for name in self._slots}
        if self._spans is not None:
            data, spans = self._spans
            out = bytearray(data)
            view = memoryview(out)
            for name, (start, size) in spans.items():
                raw = weights[name].astype("<f4", copy=False).reshape(-1).view(np.uint8)
                if raw.nbytes != size:
                    raise DataError(f"weight {name} has {raw.nbytes} bytes, the template {size}")
                view[start:start + size] = raw
            view.release()
            return bytes(out)
        with self._lock:
            for name, slot in self._slots.items():
                slot.ClearField("float_data")
                slot.raw_data = weights[name].tobytes()
            return self.proto.SerializeToString()


class TemplateCache:
    """`OnnxTemplate`s by model signature, shared by the clients of a process: a simulation,
    a benchmark or a simulated fleet exports each architecture once (26-200 ms, most of it
    holding the GIL), not once per client. Keeps the `size` most recently used."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._items: OrderedDict[tuple, OnnxTemplate] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, signature: tuple, model: nn.Module,
            sample_shape: tuple[int, ...]) -> tuple[OnnxTemplate, bool]:
        """The template of `signature`, exported from `model` if there is none yet; and
        whether this call exported it."""
        with self._lock:
            template = self._items.get(signature)
            if template is not None:
                self._items.move_to_end(signature)
                return template, False
            template = OnnxTemplate(model, sample_shape)
            self._items[signature] = template
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return template, True

    def clear(self) -> None:
        """Forget every template."""
        with self._lock:
            self._items.clear()


SHARED_TEMPLATES = TemplateCache()
"""The process's templates, used by every `ClientOnnx` unless given its own."""


class ClientOnnx:
    """onnxruntime support of one client.

    - `export_path` (LearnConfig.export_onnx; "{cid}" is replaced by the client id): after every
      global model the client writes its live model there (atomically), for an on-device
      predictor (`edgefcl predict`) to pick up.
    - score_backend "onnxruntime" (or "auto" on the CPU): TTA scoring runs the scoring
      snapshot through onnxruntime.
      The snapshot only changes when a global model arrives. Its architecture is exported once
      per process (again only when a tensor changes shape, as a growing prototype head does) as
      an `OnnxTemplate` in `templates`, shared with the process's other clients; each new
      snapshot only refills it with its weights and builds a session. A client checks the
      template against its own model once (a probe batch); a model whose refilled graph does
      not reproduce its logits is exported whole per snapshot instead.
      Before the first global the scoring model is the live model, which moves every batch;
      scoring then stays on torch. onnxruntime releases the GIL while it runs, so scoring on
      the second thread does not slow the training thread's Python.
    """

    def __init__(self, learn: LearnConfig, templates: TemplateCache = SHARED_TEMPLATES) -> None:
        self.export_path = learn.export_onnx
        self.templates = templates
        self.ort_scoring = scores_with_onnxruntime(learn)
        self.fallback = learn.score_backend == "auto"  # to torch, when the model cannot export
        self.threads = learn.threads
        # the views and the session in a worker process, started now so that its start-up
        # overlaps the rounds before the first global
        self.worker = shared_worker(learn.threads) if (
            self.ort_scoring and learn.score_process) else None
        self._snapshot = _ScoringSnapshot(f"{os.getpid()}-{id(self)}")
        self._template: tuple[tuple, OnnxTemplate | None] | None = None  # checked, by signature
        self._described: tuple[nn.Module, tuple, str] | None = None  # model, shapes, repr
        self.exports = 0
        self.export_failing = False
        self.scoring_exports = 0  # exports this client made for scoring

    def on_global(self, client: LearnerView) -> None:
        """Write the live model to the export path (if one is set); a write that fails (a
        full disk) is logged, once until one succeeds, and the device learns on."""
        if self.export_path and client.sample_shape is not None:
            path = self.export_path.replace("{cid}", client.cid)
            protos = getattr(client, "protos", None)
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                if protos is None:
                    export_onnx(client.model, client.sample_shape, path)
                else:  # the whole library, its label names in the metadata
                    data = export_onnx(client.model, client.sample_shape)
                    atomic_write(Path(path), with_labels(data, protos.library.labels))
            except OSError as e:
                if not self.export_failing:
                    log.error("%s: cannot write the model to %s (%s); it learns on without "
                              "the export", client.cid, path, e.strerror or e)
                self.export_failing = True
                return
            self.export_failing = False
            self.exports += 1

    def _snapshot_graph(self, model: nn.Module, sample_shape: tuple[int, ...]) -> bytes:
        """The ONNX graph of the scoring snapshot `model`."""
        state = model.state_dict()
        shapes = tuple((k, tuple(v.shape)) for k, v in state.items())
        if (self._described is None or self._described[0] is not model
                or self._described[1] != shapes):
            # repr walks every submodule (0.06 ms for the small CNN): once per model and shapes
            self._described = (model, shapes, repr(model))
        signature = (type(model).__name__, self._described[2], sample_shape, shapes)
        if self._template is None or self._template[0] != signature:
            template, exported = self.templates.get(signature, model, sample_shape)
            self.scoring_exports += exported
            if template.complete:
                graph = template.with_weights(state)
                # the refilled graph must compute this model: else export each snapshot whole
                if _agrees(model, OnnxModel(graph, self.threads), sample_shape):
                    self._template = (signature, template)
                    return graph
            self._template = (signature, None)
        template = self._template[1]
        if template is None:
            self.scoring_exports += 1
            return export_onnx(model, sample_shape)
        return template.with_weights(state)

    def _ready(self, client: LearnerView, x: Tensor) -> bool:
        """Whether onnxruntime scores x, with the graph of the current snapshot at hand."""
        if (not self.ort_scoring or client.score_model is None or client.perturber is None
                or client.learn.score_source != "tta"):
            return False
        snap = self._snapshot
        if snap.version != client.score_version or snap.graph is None:
            try:
                snap.graph = self._snapshot_graph(client.score_model, tuple(x.shape[1:]))
                snap.scorer = None if self.worker is not None else OnnxModel(snap.graph,
                                                                             self.threads)
            except Exception as e:  # the exporter and onnxruntime raise their own types
                if not self.fallback:
                    raise ConfigError(f"score_backend onnxruntime cannot run this model ({e}); "
                                      "use --score-backend torch") from e
                log.warning("%s: scoring falls back to torch, onnxruntime cannot run this "
                            "model: %s", client.cid, e)
                self.ort_scoring = False
                return False
            snap.version = client.score_version
        return True

    def tta_logits(self, client: LearnerView, x: Tensor) -> Tensor | None:
        """(P, N, C) logits of the TTA views of x from the onnxruntime snapshot, computed in
        this process, or None when scoring should stay on torch."""
        if not self._ready(client, x):
            return None
        return self._logits_here(client, x, client.perturber.next_seed())

    def _logits_here(self, client: LearnerView, x: Tensor, seed: int) -> Tensor:
        snap = self._snapshot
        if snap.scorer is None:
            snap.scorer = OnnxModel(snap.graph, self.threads)
        views = client.perturber(x, seed)
        flat = views.flatten(0, 1).cpu().numpy()
        z = snap.scorer.logits(flat, batch_size=client.learn.score_chunk)
        return torch.from_numpy(z).reshape(views.shape[0], views.shape[1], -1).to(x.device)

    def start_scores(self, client: LearnerView, x: Tensor, method: str) -> WorkerScores | None:
        """Send x to the scoring worker for its `method` scores, to be taken later with
        `result()`; None when no worker scores it (no worker, or one still starting, torch
        scoring, a perturber the worker cannot rebuild)."""
        spec = _perturber_spec(client.perturber)
        if (self.worker is None or spec is None or not self.worker.ready()
                or not self._ready(client, x)):
            return None
        pending = WorkerScores(self, client, x, method, client.perturber.next_seed())
        snap = self._snapshot
        try:
            pending.rid = self.worker.submit(snap.key, snap.version, snap.graph, spec, method,
                                             x.cpu().numpy(), pending.seed,
                                             client.learn.score_chunk)
        except WorkerError as e:
            self.lost_worker(client, e)
        return pending

    def lost_worker(self, client: LearnerView, error: WorkerError) -> None:
        """Score in this process from now on."""
        log.warning("%s: %s; scoring goes on in this process", client.cid, error)
        self.worker = None


class WorkerScores:
    """Scores asked of the scoring worker: `result()` waits for them; when the worker fails,
    it computes them in this process from the same view seed (the same scores)."""

    def __init__(self, onnx: ClientOnnx, client: LearnerView, x: Tensor, method: str,
                 seed: int) -> None:
        self.onnx, self.client, self.x, self.method, self.seed = onnx, client, x, method, seed
        self.rid: int | None = None  # None: the request did not reach the worker
        self.worker_seconds = 0.0

    def result(self) -> tuple[Tensor, Tensor]:
        """(P, N, C) logits and (N,) scores: on the host when the worker computed them (the
        memory checks them there, without waiting for the device, before it moves them)."""
        onnx, worker = self.onnx, self.onnx.worker
        if self.rid is not None and worker is not None:
            try:
                logits, scores, self.worker_seconds = worker.result(self.rid)
                return torch.from_numpy(logits), torch.from_numpy(scores)
            except WorkerError as e:
                onnx.lost_worker(self.client, e)
        logits = onnx._logits_here(self.client, self.x, self.seed)
        return logits, uncertainty(self.method, logits)


@dataclasses.dataclass
class _ScoringSnapshot:
    """A client's scoring snapshot as onnxruntime runs it: its graph, its session in this
    process (when scoring here) and the key of its session in the scoring worker. Not plain
    data: a checkpoint does not carry it, a restored client rebuilds it."""

    key: str
    version: int = -1
    graph: bytes | None = None
    scorer: OnnxModel | None = None


def _perturber_spec(perturber: Perturber) -> PerturberSpec | None:
    """What a scoring worker rebuilds `perturber` from; None for a perturber it cannot."""
    if type(perturber) is ImagePerturber:
        return ("image", perturber.num_views, 0.0)
    if type(perturber) is NoisePerturber:
        return ("vector", perturber.num_views, perturber.noise_std)
    return None


def _agrees(model: nn.Module, scorer: OnnxModel, sample_shape: tuple[int, ...]) -> bool:
    """Whether `scorer` gives `model`'s eval-mode logits on a random probe batch."""
    probe = torch.rand((4, *sample_shape), generator=torch.Generator().manual_seed(0))
    with eval_mode(model), torch.no_grad():
        want = model(probe.to(model_device(model))).cpu().numpy()
    got = scorer.logits(probe.numpy())
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-3, atol=1e-4))


def make_client_onnx(learn: LearnConfig) -> ClientOnnx | None:
    """The client's onnxruntime support, or None when neither option asks for it. The folder
    of `export_onnx` is created here, so that a path that cannot be written is one clear error
    before training, not a failure at the first global."""
    if not learn.export_onnx and not scores_with_onnxruntime(learn):
        return None
    if learn.export_onnx:  # the folder above the first "{cid}" (per-client ones: at export)
        folder = Path(learn.export_onnx.split("{cid}")[0] + "x").parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--export-onnx: cannot create folder {folder} "
                              f"({e.strerror or e}); give a writable path") from e
        if not os.access(folder, os.W_OK):  # a read-only mount: the first export failed
            raise ConfigError(f"--export-onnx: cannot write in folder {folder}; give a "
                              "writable path")
    return ClientOnnx(learn)
