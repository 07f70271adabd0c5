"""Fleet-batched training: the clients that learn a mini-batch in the same tick train as one
computation (`--batch-clients`).

Each client first draws what its `local_epochs` steps train on (`StreamLearner.epoch_inputs`:
its own generators, in its own order, so the draws are the ones it makes alone). Clients whose
steps have the same shapes, architecture and optimizer settings then step together: their
parameters and BatchNorm statistics are stacked along a new first axis, one forward runs them
all (batched matrix products for a chain of Linear layers, `grouped_layers`, else one
`torch.func.vmap` of `functional_call`), one backward of the sum of the clients' mean losses
gives each client its own gradient, and the optimizer's kernel (`LocalOptimizer.apply`: fused
Adam, or SGD) updates every client's rows with that client's own state in one call. The
results are written back to every client's model, so a client may step alone in the next tick
(a different shape, a prototype head, a penalty) and checkpoints are unchanged.

The memories' scores are stacked too: a client that scores its candidates by test-time views
of its scoring snapshot in torch (not by onnxruntime) leaves them to the trainer, which makes
each client's views with its own perturber and scores every client's in one stacked eval-mode
forward of their snapshots (`FleetTrainer._score`; the same logits within float tolerance, so
the same samples kept).

The memory updates end together as well: each client's full memory leaves the choice of what
it keeps to the trainer, which makes every memory's choice in one computation with one host
read (`memory_fleet.choose_together`; each memory keeps what it keeps alone, bit for bit).

Each client's step matches its sequential step within float tolerance (tests/learn/
test_batched.py); the stacked path is not bit-identical to it, so the golden hashes and the
lock-step MQTT runtime (one process per client) are compared with `--batch-clients off`.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from edgefcl.config import LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.messages import Update
from edgefcl.learn.bayes import is_bayesian
from edgefcl.learn.client import Client
from edgefcl.learn.compiled_step import PROTOTYPE_HEAD, CompiledLoss, stacked_loss
from edgefcl.learn.grouped_layers import grouped_forward
from edgefcl.learn.learner import PendingBatch, StreamLearner
from edgefcl.learn.memory_fleet import choose_together
from edgefcl.learn.optimizers import LocalOptimizer

Key = tuple[object, ...]
_FORWARDS: dict[Key, Callable] = {}
"""(architecture, train) -> the stacked forward of such models, shared by the process's
trainers: a compiled stacked step (`--compile-step`) is compiled once per forward."""


def _plain_group(opt: LocalOptimizer) -> dict | None:
    """The settings of `opt`'s one parameter group when a stacked step can apply them (a local
    optimizer with one group, without weight decay or momentum), else None."""
    if not isinstance(opt, LocalOptimizer) or len(opt.param_groups) != 1:
        return None
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    if group.get("weight_decay") or group.get("momentum") or group.get("maximize"):
        return None
    return group


def architecture_of(model: nn.Module) -> Key:
    """What must match for models to share a stacked forward (`train_stacked`'s and
    `peek_stacked`'s `architecture`): the model's class, its description (settings no state
    shape shows, as BatchNorm's momentum) and the names and shapes of its state."""
    return (type(model), repr(model),
            tuple((n, tuple(t.shape)) for n, t in model.state_dict().items()))


def batch_clients(learn: LearnConfig) -> bool:
    """Whether a run stacks its clients' steps: `learn.batch_clients`, where auto means on
    with CUDA (a client's step is launch-bound there) and off on CPU (see docs/speed.md)."""
    if learn.batch_clients == "auto":
        return torch.device(learn.device).type == "cuda"
    return learn.batch_clients == "on"


def why_alone(client: Client) -> str | None:
    """Why `client`'s training step cannot be stacked with others' (None: it can; stacked
    steps are the plain loss of a fixed-head model under a plain Adam or SGD)."""
    learner = client.learner
    if learner.protos is not None:
        return PROTOTYPE_HEAD
    if not client.hooks.plain_training():
        return f"method {learner.learn.method} adds a loss term or transforms the model"
    if _plain_group(learner.opt) is None:
        return "its optimizer has weight decay, momentum or several parameter groups"
    return None


def stackable(client: Client) -> bool:
    """Whether `client`'s training step can be stacked with others' (`why_alone`)."""
    return why_alone(client) is None


def _accuracies(client: Client, sets: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """`client`'s accuracy on each (x, y) of `sets`, evaluated alone."""
    return np.array([client.evaluate(x, y) for x, y in sets])


def _rows(parts: Sequence[np.ndarray], start: int, n: int) -> np.ndarray:
    """Rows [start, start + n) of the concatenation of `parts`, copying only those."""
    out, offset = [], 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(start + n - offset, len(part))
        if lo < hi:
            out.append(part[lo:hi])
        offset += len(part)
    return np.concatenate(out)


def _by_client(stacked: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of the `stacked` tensors (views), client by client: the order in which the
    optimizer states of a stacked step are listed."""
    return [row for rows in zip(*(t.unbind() for t in stacked), strict=True) for row in rows]


class FleetTrainer:
    """Steps many clients' mini-batches: stacked where they can be (see the module docstring),
    one after another where they cannot, and scores their memories' candidates stacked too
    (`_score`). `stacked_steps` and `alone_steps` count client mini-batches of each kind,
    `stacked_scores` the candidate sets scored stacked."""

    def __init__(self) -> None:
        self._layouts: dict[StreamLearner, Key | None] = {}  # None: steps alone
        self._losses: dict[Key, CompiledLoss] = {}  # layout -> its compiled stacked loss
        self.stacked_steps = 0
        self.alone_steps = 0
        self.stacked_scores = 0

    def counts(self) -> dict[str, int]:
        """What a run's results report of the stacking."""
        return {"stacked_steps": self.stacked_steps, "stacked_scores": self.stacked_scores}

    def step(self, clients: Sequence[Client], batches: Sequence[Batch]) -> list[Update | None]:
        """Each client learns its batch (as `Client.step` does); returns their updates."""
        if not clients:
            return []
        now = clients[0].learner.clock.now  # on CUDA: after the queued kernels
        xs, peeks = self._peek(clients, batches)
        pending = []
        for c, b, x, peek in zip(clients, batches, xs, peeks, strict=True):
            t0 = now()
            pending.append(c.learner.begin(b, x, peek,
                                           defer_scores=self._layout(c) is not None))
            pending[-1].trained = now() - t0
        self._score(clients, pending)
        groups: dict[Key, list[tuple[int, list]]] = {}
        for i, (c, p) in enumerate(zip(clients, pending, strict=True)):
            t0 = now()
            layout = self._layout(c)
            if layout is None:
                self._alone(c.learner, c.learner.epoch_inputs(p.x, p.y))
                p.trained += now() - t0  # type: ignore[operator]
                continue
            inputs = list(c.learner.epoch_inputs(p.x, p.y))
            p.trained += now() - t0  # type: ignore[operator]
            key = (*layout, tuple((tuple(x.shape), tuple(y.shape)) for x, y in inputs))
            groups.setdefault(key, []).append((i, inputs))
        for key, members in groups.items():
            t0 = now()
            if len(members) == 1:
                self._alone(clients[members[0][0]].learner, members[0][1])
            else:
                self._stacked(key, [(clients[i].learner, inputs) for i, inputs in members])
            share = (now() - t0) / len(members)
            for i, _ in members:
                pending[i].trained += share  # type: ignore[operator]
        return self._finish(clients, pending)

    def _peek(self, clients: Sequence[Client], batches: Sequence[Batch]
              ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per client, its batch's samples on its device and its monitor's logits of them
        (None: the client's `begin` computes them alone), for the clients that look at logits
        before training and stack with another (the same layout and batch shape): one stacked
        eval-mode forward for each such group. The seconds count as their monitors'."""
        xs: list[torch.Tensor | None] = [None] * len(clients)
        peeks: list[torch.Tensor | None] = [None] * len(clients)
        groups: dict[Key, list[int]] = {}
        for i, (c, b) in enumerate(zip(clients, batches, strict=True)):
            monitor, layout = c.learner.monitor, self._layout(c)
            if monitor is not None and monitor.needs_logits and layout is not None:
                groups.setdefault((*layout, b.x.shape), []).append(i)
        for key, members in groups.items():
            if len(members) < 2:
                continue
            learners = [clients[i].learner for i in members]
            t0 = learners[0].clock.now()
            x = [torch.from_numpy(batches[i].x).to(lr.device)
                 for i, lr in zip(members, learners, strict=True)]
            logits = self.peek_stacked([lr.model for lr in learners], torch.stack(x), key[0])
            share = (learners[0].clock.now() - t0) / len(members)
            for k, (i, lr) in enumerate(zip(members, learners, strict=True)):
                xs[i], peeks[i] = x[k], logits[k]
                lr.timings["monitor"] += share
        return xs, peeks

    def _score(self, clients: Sequence[Client], pending: Sequence[PendingBatch]) -> None:
        """Score the candidates the clients' `begin` left (`PendingBatch.candidates`): each
        client's test-time views of its own candidates (its own perturber, in its own order),
        then one stacked eval-mode forward of every client's scoring snapshot on its views
        (candidate counts padded to the group's largest) for the clients with the same layout,
        candidate shape and view count; a client alone in its group scores on its own thread.
        The seconds count as each client's scoring, shared equally."""
        groups: dict[Key, list[int]] = {}
        for i, (c, p) in enumerate(zip(clients, pending, strict=True)):
            if p.candidates is not None:
                key = (*self._layout(c), tuple(p.candidates.shape[1:]),  # type: ignore[misc]
                       c.learner.perturber.num_views)  # type: ignore[union-attr]
                groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            learners = [clients[i].learner for i in members]
            if len(members) == 1:
                p = pending[members[0]]
                p.ahead = learners[0].score_ahead(p.candidates)  # type: ignore[arg-type]
                continue
            t0 = learners[0].clock.now()
            views = [lr.perturber(pending[i].candidates.to(lr.device))  # type: ignore[misc]
                     for i, lr in zip(members, learners, strict=True)]  # each (P, N_k, ...)
            n = max(v.shape[1] for v in views)
            padded = views[0].new_zeros((len(views), views[0].shape[0], n, *views[0].shape[2:]))
            for k, v in enumerate(views):
                padded[k, :, :v.shape[1]] = v
            logits = self.peek_stacked([lr.score_model for lr in learners],  # type: ignore[misc]
                                       padded.flatten(1, 2), key[0])
            logits = logits.reshape(len(views), views[0].shape[0], n, -1)
            share = (learners[0].clock.now() - t0) / len(members)
            for k, (i, lr) in enumerate(zip(members, learners, strict=True)):
                pending[i].ahead = lr.scored_with_others(logits[k, :, :views[k].shape[1]],
                                                         share)
            self.stacked_scores += len(members)

    @torch.no_grad()
    def evaluate(self, clients: Sequence[Client],
                 tests: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]],
                 chunk: int = 1024, stack: bool | None = None) -> list[np.ndarray]:
        """Each client's accuracy on each of its (x, y) test sets, what `Client.evaluate`
        gives it alone (within float order): clients that stack and whose test sets have the
        same sizes evaluate together, in stacked eval-mode forwards of `chunk` samples in all,
        and read their correct counts back once; the others evaluate alone. `stack` None: on
        accelerators only (on CPU a forward of a few hundred samples is compute-bound, and the
        stacked one measured slower: docs/speed.md)."""
        out: list[np.ndarray | None] = [None] * len(clients)
        groups: dict[Key, list[int]] = {}
        for i, (c, sets) in enumerate(zip(clients, tests, strict=True)):
            layout = self._layout(c)
            sampled = c.learn.eval_samples > 0 and is_bayesian(c.model)  # posterior draws
            stacks = c.device.type != "cpu" if stack is None else stack
            if not stacks or layout is None or sampled or any(len(y) == 0 for _, y in sets):
                out[i] = _accuracies(c, sets)
                continue
            shapes = tuple(x.shape for x, _ in sets)
            groups.setdefault((*layout, shapes), []).append(i)
        for key, members in groups.items():
            if len(members) == 1:
                out[members[0]] = _accuracies(clients[members[0]], tests[members[0]])
                continue
            models = [clients[i].model for i in members]
            dev = clients[members[0]].device
            y = torch.from_numpy(np.stack([np.concatenate(
                [clients[i].learner.head.targets(y) for _, y in tests[i]]) for i in members]))
            right = torch.empty(y.shape, dtype=torch.bool, device=dev)
            per = max(1, chunk // len(members))  # `chunk` samples a forward, all clients
            for at in range(0, y.shape[1], per):
                xb = torch.from_numpy(np.stack([_rows([x for x, _ in tests[i]], at, per)
                                                for i in members])).to(dev)
                pred = self.peek_stacked(models, xb, key[0]).argmax(-1)
                right[:, at:at + per] = pred.eq(y[:, at:at + per].to(dev))
            sizes = [len(y) for _, y in tests[members[0]]]
            counts = torch.stack([part.sum(1) for part in right.split(sizes, 1)], 1).cpu()
            for k, i in enumerate(members):
                out[i] = counts[k].numpy() / np.array(sizes)
        return out  # type: ignore[return-value]

    @staticmethod
    def _finish(clients: Sequence[Client], pending: Sequence[PendingBatch]
                ) -> list[Update | None]:
        """Each client's memory update and counters, their memories' choices of what they
        keep made together (`memory_fleet`), then what each client does after learning."""
        for c, p in zip(clients, pending, strict=True):
            c.learner.finish(p, defer=True)
        now = clients[0].learner.clock.now
        t0 = now()
        choose_together([r for c in clients if c.learner.memory is not None
                         and (r := c.learner.memory.take_deferred()) is not None])
        share = (now() - t0) / len(clients)
        for c in clients:
            c.learner.timings["memory"] += share
        return [c.after_learning() for c in clients]

    def _layout(self, client: Client) -> Key | None:
        """What must match for `client` to step with others (model architecture, optimizer
        settings, device), worked out once per client; None when it steps alone."""
        learner = client.learner
        if learner not in self._layouts:
            self._layouts[learner] = None if not stackable(client) else (
                architecture_of(learner.model), repr(_plain_group(learner.opt)), learner.device)
        return self._layouts[learner]

    def _alone(self, learner: StreamLearner, inputs: Iterable) -> None:
        learner.train_on(inputs)
        self.alone_steps += 1

    def _stacked(self, key: Key, members: list[tuple[StreamLearner, list]]) -> None:
        learners = [m[0] for m in members]
        args = ([lr.model for lr in learners], [lr.opt for lr in learners],
                [m[1] for m in members], key[0])
        self.stacked_steps += len(members)
        loss = self._loss(key[:-1], learners[0])
        if loss is None:
            self.train_stacked(*args)
            return
        seconds, compiled, eager = loss.timings["compile"], loss.compiled_steps, loss.eager_steps
        self.train_stacked(*args, loss)
        for lr in learners:  # each client's share: compile time (not training), and its local
            # steps, compiled or eager, counted by its own loss as if it stepped alone
            lr.timings["compile"] += (loss.timings["compile"] - seconds) / len(learners)
            if isinstance(lr.loss, CompiledLoss):
                lr.loss.compiled_steps += loss.compiled_steps - compiled
                lr.loss.eager_steps += loss.eager_steps - eager

    def _loss(self, layout: Key, learner: StreamLearner) -> CompiledLoss | None:
        """The compiled stacked loss of `layout`'s group, when its clients compile their own
        steps (`--compile-step`), else None (eager)."""
        if not isinstance(learner.loss, CompiledLoss):
            return None
        if layout not in self._losses:
            own = learner.loss  # the same policy as the clients' own steps
            self._losses[layout] = CompiledLoss(learner.device, Counter(), own.min_uses,
                                                own.max_shapes, fn=stacked_loss)
        return self._losses[layout]

    @staticmethod
    def _forward(model: nn.Module, architecture: Key, train: bool) -> Callable:
        """The stacked forward of models like `model` over a stacked first axis of
        parameters, buffers and inputs, in train or eval mode: batched matrix products for a
        chain of Linear layers (`grouped_layers`), else vmap of `functional_call`."""
        key = (architecture, train)
        if key not in _FORWARDS:
            meta = copy.deepcopy(model).to("meta").train(train)
            _FORWARDS[key] = grouped_forward(meta) or vmap(
                lambda params, buffers, x: functional_call(meta, (params, buffers), (x,)))
        return _FORWARDS[key]

    @torch.no_grad()
    def peek_stacked(self, models: Sequence[nn.Module], xs: torch.Tensor,
                     architecture: Key | None = None) -> torch.Tensor:
        """Each model's eval-mode logits of its own samples, (K, N, C) for xs (K, N, ...), in
        one stacked forward: what `drift.peek_logits` gives each model alone, within float
        tolerance. The models are unchanged."""
        first = models[0]
        forward = self._forward(first, architecture or architecture_of(first), train=False)
        state = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in models]
        params = {n: torch.stack([s[n] for s in state]) for n, _ in first.named_parameters()}
        buffers = {n: torch.stack([s[n] for s in state]) for n, _ in first.named_buffers()}
        return forward(params, buffers, xs)

    def train_stacked(self, models: Sequence[nn.Module],
                      optimizers: Sequence[LocalOptimizer],
                      inputs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                      architecture: Key | None = None,
                      loss_of: Callable[..., torch.Tensor] = stacked_loss) -> None:
        """One optimizer step of every model per (x, y) of its `inputs` (the same shapes and
        optimizer settings for all, see `stackable`), all models at once, in train mode: models
        and optimizers end as if each had stepped alone. `architecture` names the models'
        shared layout, to reuse its stacked forward (default: read from the first model);
        `loss_of`: `stacked_loss`, or a `CompiledLoss` of it."""
        first = models[0]
        forward = self._forward(first, architecture or architecture_of(first), train=True)
        names = [n for n, _ in first.named_parameters()]
        per_model = [list(m.parameters()) for m in models]  # in the order of `names`
        params = {n: torch.stack([p[i].detach() for p in per_model]).requires_grad_()
                  for i, n in enumerate(names)}
        bufs = [dict(m.named_buffers()) for m in models]
        buffers = {n: torch.stack([b[n] for b in bufs]) for n in bufs[0]}
        # the optimizer steps each client's rows of the stacked parameters (views) with that
        # client's own state, all in one call
        with torch.no_grad():
            views = _by_client([params[n] for n in names])
        opt = optimizers[0]
        group = _plain_group(opt)
        states = [opt_k.state_of(q) for opt_k, p in zip(optimizers, per_model, strict=True)
                  for q in p]
        for epoch in range(len(inputs[0])):
            xs = torch.stack([own[epoch][0] for own in inputs])
            ys = torch.stack([own[epoch][1] for own in inputs])
            # the sum of the clients' mean losses: each client's gradient is its own
            loss = loss_of(forward, params, buffers, xs, ys)
            g = torch.autograd.grad(loss, [params[n] for n in names])
            with torch.no_grad():
                # contiguous, as the fused kernel reads each view's memory in the parameter's
                # layout (a stacked Linear's gradient comes transposed)
                g_views = _by_client([t.contiguous() for t in g])
                type(opt).apply(views, g_views, states, group)  # type: ignore[arg-type]
        with torch.no_grad():
            for k, (model, p) in enumerate(zip(models, per_model, strict=True)):
                model.train()
                torch._foreach_copy_(p, [params[n][k] for n in names])
                for n, b in bufs[k].items():
                    b.copy_(buffers[n][k])
