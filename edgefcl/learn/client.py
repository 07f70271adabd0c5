"""The online client: one pass over a stream, replay memory ranked by uncertainty, and the
burn-in / jump schedule that decides when it sends an update (NOTES.md §1, Algorithm 1)."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from edgefcl.config import ConfigError, FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.federation.registry import get_encoding
from edgefcl.federation.schedule import eligible
from edgefcl.federation.versions import DownlinkState
from edgefcl.learn.bayes import predict_logits, score_logits
from edgefcl.learn.checkpoint import client_state, load_client_state
from edgefcl.learn.drift import make_monitor
from edgefcl.learn.export import make_client_onnx
from edgefcl.learn.memory import ReplayMemory
from edgefcl.learn.methods import get_method
from edgefcl.learn.models import penultimate
from edgefcl.learn.params import get_tensors, set_tensors
from edgefcl.learn.perturb import augment_batch, eval_mode, make_perturber
from edgefcl.learn.scores import uncertainty
from edgefcl.learn.selection import get_selection
from edgefcl.learn.variational import client_hooks


def resolve_device(name: str) -> torch.device:
    """A torch device, with a clear error when CUDA is asked for but absent."""
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{name}' requested but CUDA is not available; use --device cpu")
    return dev


class Client:
    """An online federated continual learner.

    `step(batch)` trains on the batch plus a replay draw, updates the memory, counts the batch
    and returns an Update when the schedule says this client takes part. `apply_global(g)`
    merges a new global model.
    """

    def __init__(self, cid: str, model: torch.nn.Module, learn: LearnConfig, fed: FedConfig,
                 data_kind: str, seed: int = 0) -> None:
        self.cid = cid
        self.learn = learn
        self.fed = fed
        self.method = learn.method
        self.device = resolve_device(learn.device)
        if learn.score_chunk == 0:
            self.learn = learn = dataclasses.replace(
                learn, score_chunk=4096 if self.device.type == "cuda" else 256)
        self.hooks = client_hooks(self.method, learn, fed)
        self.model = self.hooks.prepare_model(model).to(self.device)
        self.gen = torch.Generator().manual_seed(seed)
        self.data_kind = data_kind
        params = list(self.model.parameters())
        self.opt = (torch.optim.Adam(params, lr=learn.lr) if learn.optimizer == "adam"
                    else torch.optim.SGD(params, lr=learn.lr))
        spec = get_method(self.method)
        self._policy = spec.memory if learn.memory_size > 0 else None
        self.selection = get_selection(learn.selection)  # unknown names fail here, early
        self.memory: ReplayMemory | None = None  # allocated on the first batch (sample shape)
        self.score_method = spec.score
        self.perturber = (make_perturber(data_kind, learn.perturbations, learn.noise_std, seed)
                          if spec.memory == "balanced-score" else None)
        self.score_model: torch.nn.Module | None = None
        self.score_version = 0
        self.version = 0
        self.seq = 0
        self.task: int | None = None
        self.bn = 0
        self.samples_in_task = 0
        self.class_counts: dict[int, int] = {}
        self.encoder = get_encoding(fed.encoding).make_encoder(fed)
        self.base = get_tensors(self.model)  # state of the last global merged
        self.downlink = DownlinkState(self.base)  # turns delta globals into whole ones
        self.sent: dict[str, np.ndarray] | None = None
        self.scored = 0
        self.batches = 0
        # seconds on the client's thread, additive: train, score, score_wait (waiting for the
        # scores computed while training), memory (excl. score), monitor
        self.timings: Counter[str] = Counter()
        self.background: Counter[str] = Counter()  # seconds on the scoring thread: score
        self.sample_shape: tuple[int, ...] | None = None  # of the last batch
        self.monitor = make_monitor(learn)  # prequential accuracy, task-free segments
        self.onnx = make_client_onnx(learn)  # export_onnx, score_backend onnxruntime
        self.skip_scoring = False  # set by a device over its compute budget (firmware_sim)
        self._pool: ThreadPoolExecutor | None = None  # scores ahead while training
        self.scored_ahead = 0  # batches whose scores were computed while training
        self.hooks.attach(self)

    # -- the online step --------------------------------------------------------------------
    def step(self, batch: Batch) -> Update | None:
        """Process one mini-batch once; an Update when this client takes part now."""
        x = torch.from_numpy(batch.x).to(self.device)
        y = torch.from_numpy(batch.y).to(self.device)
        self.sample_shape = tuple(batch.x.shape[1:])
        # task-free: the monitor's detected segment stands in for the true task
        task = batch.task if self.monitor is None else self.monitor.observe(self, batch, x, y)
        if task != self.task:
            self._start_task(task)
        t0 = self._clock()
        ahead = self._score_ahead(x, y)
        self._train(x, y)
        t1 = self._clock()
        scores = None
        if ahead is not None:
            scores = ahead.result()
            self.scored_ahead += 1
        t_mem = self._clock()
        score_before = self.timings["score"]
        self._update_memory(x, y, scores)
        t2 = self._clock()
        self.timings["train"] += t1 - t0
        self.timings["score_wait"] += t_mem - t1
        self.timings["memory"] += (t2 - t_mem) - (self.timings["score"] - score_before)
        self.batches += 1
        self.bn += 1
        self.samples_in_task += len(batch.y)
        labels, counts = np.unique(batch.y, return_counts=True)
        for c, n in zip(labels.tolist(), counts.tolist(), strict=True):
            self.class_counts[c] = self.class_counts.get(c, 0) + n
        if not eligible(self.bn, self.fed.burn_in, self.fed.jump):
            return None
        self.seq += 1
        self.sent = get_tensors(self.model)
        payload = self.encoder.encode(self.sent, self.base)
        return Update(self.cid, self.version, self.seq, self.task or 0, self.bn,
                      self.samples_in_task, payload, self.encoder.name, dict(self.class_counts))

    def tick(self) -> Tick:
        """A lock-step report for a mini-batch at which this client is not eligible."""
        self.seq += 1
        return Tick(self.cid, self.seq, self.task or 0, self.bn)

    def _start_task(self, task: int) -> None:
        self.task = task
        self.bn = 0
        self.samples_in_task = 0
        self.class_counts = {}
        self.hooks.on_task_start(self, task)

    def _train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.train()
        for epoch in range(self.learn.local_epochs):
            xb = x if epoch == 0 else augment_batch(x, self.data_kind, self.gen)
            yb = y
            if self.memory is not None:
                replay = self.memory.sample(len(y), exclude_task=self.task)
                if replay is not None:
                    xb = torch.cat([xb, replay[0]])
                    yb = torch.cat([yb, replay[1]])
            loss = F.cross_entropy(self.model(xb), yb)
            extra = self.hooks.penalty(self)
            if extra is not None:
                loss = loss + extra
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()

    # -- memory ---------------------------------------------------------------------------
    def _score_ahead(self, x: torch.Tensor, y: torch.Tensor) -> Future | None:
        """Start scoring, on a second thread, the candidates the memory update after this
        batch will need, when they are known before training: the scoring model must be the
        frozen snapshot (not the model being trained). The scores are identical to scoring
        after training; the perturber is only used by one thread at a time."""
        if (not self.learn.score_overlap or self.learn.score_backend != "torch"
                or self.memory is None or self.score_model is None
                or self._policy != "balanced-score" or self.skip_scoring):
            return None
        cands = self.memory.pending_scores(x, y, self.task or 0, self.score_version,
                                           rescore_all=self.learn.rescore == "always",
                                           keep_stale=self.learn.rescore == "never")
        if cands is None:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"score-{self.cid}")
        return self._pool.submit(self._score, cands, self.background)

    def _update_memory(self, x: torch.Tensor, y: torch.Tensor,
                       scores: torch.Tensor | None = None) -> None:
        if self._policy is None:
            return
        if self.memory is None:
            self.memory = ReplayMemory(self.learn.memory_size, tuple(x.shape[1:]), self._policy,
                                       self.learn.selection, self.device,
                                       int(torch.randint(0, 2**31 - 1, (1,),
                                                         generator=self.gen)),
                                       rank_past=self.learn.rank_past)
        scorer = self._score if self._policy == "balanced-score" else None
        if self.score_model is None:
            # No snapshot yet: the scoring model is the current model, which moved this batch.
            self.score_version += 1
        version = self.score_version
        if scorer is not None and self.skip_scoring:
            # over the compute budget: class-balanced random this batch (version -1: stale)
            scorer, version = self._random_scores, -1
        featurizer = self._features if self.selection.needs_features else None
        scored = self.memory.update(x, y, self.task or 0, scorer, version,
                                    rescore_all=self.learn.rescore == "always",
                                    featurizer=featurizer,
                                    keep_stale=self.learn.rescore == "never", scores=scores)
        self.scored += scored if version >= 0 else 0

    def _random_scores(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rand(len(x), generator=self.gen).to(x.device)

    def _score(self, x: torch.Tensor, timings: Counter | None = None) -> torch.Tensor:
        t0 = self._clock()
        model = self.score_model if self.score_model is not None else self.model
        logits = self.onnx.tta_logits(self, x) if self.onnx is not None else None
        if logits is None:
            logits = score_logits(model, x, self.learn.score_source, self.perturber,
                                  self.learn.score_samples, self.learn.score_chunk)
        scores = uncertainty(self.score_method, logits)
        (self.timings if timings is None else timings)["score"] += self._clock() - t0
        return scores

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features of the scoring model (eval mode, no grad), for rules that
        select by features."""
        t0 = self._clock()
        model = self.score_model if self.score_model is not None else self.model
        with eval_mode(model), torch.inference_mode():
            f = penultimate(model, x)
        self.timings["score"] += self._clock() - t0
        return f.clone()

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume this client after a reboot (see learn/checkpoint.py)."""
        return client_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` into a client built from the same configuration."""
        load_client_state(self, state)

    # -- federation -----------------------------------------------------------------------
    def apply_global(self, g: GlobalModel, merge: str = "replace") -> None:
        """Merge a global model this client took part in.

        replace: theta = theta_global (lock-step, Algorithm 1).
        delta: theta = theta_global + (theta_now - theta_sent) for the learned parameters,
        keeping the progress made since the update was sent (async); statistics buffers
        (BatchNorm) take the global's value.
        The model as it was just before the merge becomes the scoring snapshot.
        `g` may be a delta from the version this client holds (sparse downlink).
        """
        g = self.downlink.resolve(g)
        if self.perturber is not None:
            if self.score_model is None:
                self.score_model = copy.deepcopy(self.model)
            else:
                self.score_model.load_state_dict(self.model.state_dict())
            self.score_version += 1
        now = get_tensors(self.model)
        merged = self.encoder.decode_global(g.tensors, now)
        self.base = merged
        if merge == "delta" and self.sent is not None:
            # Only learned parameters are additive: BatchNorm statistics take the global's
            # value (a running variance moved by a delta can turn negative: NaN in eval mode).
            params = dict(self.model.named_parameters())
            merged = {k: merged[k] + (now[k] - self.sent[k]) if k in params else merged[k]
                      for k in merged}
        set_tensors(self.model, merged)
        self.version = g.version
        self.hooks.on_global(self, g)
        if self.onnx is not None:
            self.onnx.on_global(self)

    # -- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> float:
        """Accuracy (fraction) of the current model on (x, y), in eval mode."""
        if len(y) == 0:
            return float("nan")
        was_training = self.model.training
        self.model.eval()
        correct = 0
        for i in range(0, len(y), batch_size):
            xb = torch.from_numpy(x[i:i + batch_size]).to(self.device)
            pred = predict_logits(self.model, xb, self.learn.eval_samples).argmax(1).cpu().numpy()
            correct += int((pred == y[i:i + batch_size]).sum())
        self.model.train(was_training)
        return correct / len(y)
