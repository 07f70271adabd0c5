"""The client's side of the prototype library: label names and ids of a batch, the warm-up of new
classes, training with the assembled classifier, prediction over the whole library and the
library's part of updates and globals (FedBNN §IV-B). Used by `Client` when its head is
`prototypes`; every step is vectorised over the samples (loops run over distinct labels)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from edgefcl.data.labels import check_names, label_id, label_names
from edgefcl.federation.label_rows import LabelRows
from edgefcl.learn.models import eval_mode
from edgefcl.learn.optimizers import LocalOptimizer
from edgefcl.learn.proto_net import ProtoNet, PrototypeLibrary


class PrototypeHead:
    """Binds a client's `ProtoNet` to its optimiser settings and the ids of its label names.

    Batches and test sets carry label names (strings; integer labels are named by their
    decimal string). Inside the device a name is its `label_id` (replay memory groups, class
    counts): a function of the name alone, so no class list is needed up front."""

    def __init__(self, model: ProtoNet, optimizer: str, lr: float, device: torch.device,
                 warmup_steps: int, share: bool, sigma: float | None = None) -> None:
        self.model = model
        model.library = PrototypeLibrary(model.dim, optimizer, lr, device, sigma)
        self.by_id: dict[int, str] = {}
        self.warmup_steps = warmup_steps
        self.share = share
        self.sent: LabelRows | None = None
        self.warmups = 0  # batches that began with a warm-up (a new label)
        self.live: tuple[Tensor, Tensor, Tensor] | None = None
        """Gaussian rows of the step in progress (idx, mu, rho leaves), for `row_kl`."""

    @property
    def library(self) -> PrototypeLibrary:
        return self.model.library

    @property
    def empty(self) -> bool:
        """Whether the library holds no label yet."""
        return len(self.library) == 0

    def ids(self, y: np.ndarray) -> np.ndarray:
        """int64 ids of labels `y` (names or integers), registering new names. Raises
        ValueError for a name out of bounds or an id two names share."""
        names, inverse = label_names(y)
        reason = check_names(names)
        if reason is not None:
            raise ValueError(f"batch labels: {reason}")
        ids = np.array([label_id(n) for n in names], np.int64)
        for i, n in zip(ids.tolist(), names, strict=True):
            if self.by_id.setdefault(i, n) != n:
                raise ValueError(f"labels {n!r} and {self.by_id[i]!r} share id {i}")
        return ids[inverse] if len(names) else np.zeros(0, np.int64)

    def name(self, c: int) -> str:
        return self.by_id[c]

    def rows_of(self, y: Tensor) -> tuple[Tensor, Tensor, int]:
        """(library rows of the distinct labels of ids `y`, each sample's position among
        them, how many labels were new)."""
        uniq, inverse = torch.unique(y, return_inverse=True)
        idx, new = self.library.ensure([self.name(c) for c in uniq.tolist()])
        return idx, inverse, new

    # -- training -----------------------------------------------------------------------------
    def warmup(self, x: Tensor, y: Tensor) -> None:
        """New labels in the batch: `warmup_steps` steps on the batch's assembled classifier
        with the extractor frozen (eval mode, no gradient). Gaussian rows: the means move,
        rho does not (the extractor does not sample in eval mode, so neither do the rows)."""
        idx, target, new = self.rows_of(y)
        if new == 0 or self.warmup_steps <= 0:
            return
        self.warmups += 1
        with eval_mode(self.model.extractor), torch.no_grad():
            feats = self.model.extractor(x)
        for _ in range(self.warmup_steps):
            w = self.library.rows[idx].detach().requires_grad_()
            loss = F.cross_entropy(self.library.logits(feats, w), target)
            (grad,) = torch.autograd.grad(loss, w)
            self.library.step(idx, grad)

    def train_step(self, xb: Tensor, yb: Tensor, opt: LocalOptimizer,
                   penalty: Callable[[], Tensor | None]) -> None:
        """One step of extractor + assembled classifier (classes of `yb`: batch and replay).
        Gaussian rows: the classifier is a draw mu + sigma * eps when the extractor samples
        (after the extractor's draws, from its generator) and the method's penalty may add
        `row_kl` (BayesHooks)."""
        idx, target, _ = self.rows_of(yb)
        lib = self.library
        w = mu = lib.rows[idx].detach().requires_grad_()
        feats = self.model.extractor(xb)
        rho = None
        if lib.gaussian:
            rho = lib.rho[idx].detach().requires_grad_()
            draw, generator = self.model.sampling()
            if draw:
                w = lib.draw(mu, rho, generator)
            self.live = (idx, mu, rho)
        try:
            loss = F.cross_entropy(lib.logits(feats, w), target)
            extra = penalty()
        finally:
            self.live = None
        if extra is not None:
            loss = loss + extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lib.step(idx, mu.grad, rho.grad if rho is not None else None)

    def row_kl(self) -> Tensor | None:
        """KL( assembled Gaussian rows || their prior ) of the step in progress (None outside
        a step or for point rows): the rows' part of the Bayesian prior term."""
        if self.live is None:
            return None
        return self.library.kl(*self.live)

    def count(self, y: np.ndarray) -> None:
        labels, counts = np.unique(y, return_counts=True)
        self.library.count([self.name(c) for c in labels.tolist()], counts.tolist())

    # -- federation ---------------------------------------------------------------------------
    def outgoing(self, likelihood: bool = False) -> LabelRows | None:
        """The rows this update carries (None when the library stays local): the posterior
        rows, or with `likelihood` (fedbnn aggregation, Gaussian rows) their likelihoods
        (`PrototypeLibrary.likelihood_table`). `sent` keeps the posterior rows (delta merge)."""
        if not self.share:
            return None
        self.sent = self.library.table()
        if likelihood and self.library.gaussian:
            return self.library.likelihood_table(self.sent)
        return self.sent

    def merge(self, table: LabelRows | None, keeps_local: bool) -> None:
        """Take the global library; `keeps_local`: rows this device sent keep their progress
        since (the async delta merges)."""
        if table is None or not self.share:
            return
        self.library.merge(table, self.sent if keeps_local else None)

    def snapshot_into(self, snapshot: ProtoNet) -> None:
        """The scoring snapshot's classifier: the rows of the labels this device trained on
        (the assembled classifier of its own classes), copies."""
        snapshot.library = self.library.subset(list(self.library.counts))

    # -- persistence --------------------------------------------------------------------------
    def state(self, snapshot: ProtoNet | None) -> dict:
        """The library, the last table sent and the scoring snapshot's rows (checkpoints)."""
        return {"library": self.library.state(), "sent": self.sent, "warmups": self.warmups,
                "snapshot": snapshot.library.state() if snapshot is not None else None}

    def load(self, state: dict, snapshot: ProtoNet | None) -> None:
        self.library.load(state["library"])
        self.by_id = {label_id(n): n for n in self.library.labels}  # ids are the names'
        self.sent = state["sent"]
        self.warmups = int(state["warmups"])
        if snapshot is not None and state["snapshot"] is not None:
            snapshot.library = PrototypeLibrary(self.library.dim, self.library.optimizer,
                                                self.library.lr, self.library.device,
                                                self.library.sigma0)
            snapshot.library.load(state["snapshot"])

    # -- prediction ---------------------------------------------------------------------------
    def targets(self, y: np.ndarray) -> np.ndarray:
        """Library row of each sample's label, names or integers (-1: a label the library
        does not hold)."""
        names, inverse = label_names(y)
        at = np.array([self.library.index.get(n, -1) for n in names], np.int64)
        return at[inverse] if len(names) else np.zeros(0, np.int64)

    def coverage(self, test_labels: list[np.ndarray]) -> tuple[int, int]:
        """(labels the library knows now, test samples among `test_labels` whose label it
        does not know: evaluation counts those wrong)."""
        unknown = sum(int((self.targets(y) < 0).sum()) for y in test_labels)
        return len(self.library), unknown

    def predict_names(self, logits: Tensor) -> list[str]:
        """Label names of the argmax rows of logits over the whole library."""
        return [self.library.labels[i] for i in logits.argmax(1).tolist()]
