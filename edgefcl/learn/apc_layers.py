"""APC / FedWeIT on the client (docs/algorithms.md §2): every Linear and Conv2d weight becomes

    theta(t) = B ⊙ sigmoid(m(t)) + A(t) + sum_s alpha_s * KB_s

B: the base, federated under the layer's original weight name (so the global spec is the plain
model's); m(t): a per-output-unit mask (real logits); A(t): the task-adaptive parameters;
KB: the knowledge base of task-adaptive parameters broadcast by the server (other clients'
and this client's past tasks), weighted by the attention alpha. m, A and alpha are local.

Loss extra (MethodHooks.penalty):
    lambda1 * (|sigmoid(m(t))|_1 + |A(t)|_1)
  + (lambda2 / 2) * sum_{i<t} || B ⊙ sigmoid(m(i)) + A(i) - theta(i) ||^2
theta(i) is the composed weight stored when task i ended, i.e. the "+" form of the retroactive
term keeps every past task's weights fixed. A(i) is solved in closed form for the current B
(A(i) = theta(i) - B ⊙ sigmoid(m(i)), hard-thresholded at `apc_prune` like the authors' code,
which prunes at 1e-3 with a learning rate of 3.3e-4; the default 0.03 keeps that ratio to
edgefcl's lr 0.01, below which Adam's steps leave A almost dense):
only the entries pruned to zero leave a residual, which pulls B back. The last MAX_PAST tasks
are kept.

Communication: each update sends the rows of B of the `apc_send` fraction of units with the
largest mask (the authors' code sends B where the mask is above its 30th percentile), dense
biases and BatchNorm tensors, and, once per task, the pruned A of the task just finished.

Evaluation in edgefcl is class-incremental without task ids, so the model always runs the
current task's composition; like the CBR baseline, the APC client keeps a class-balanced random
replay memory (`--memory-size`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import ConfigError, LearnConfig
from edgefcl.federation.apc_rule import KB, APCEncoder
from edgefcl.federation.messages import GlobalModel, Tensors
from edgefcl.federation.sparse import IDX, ROWS, VAL, encode_indices, to_values
from edgefcl.learn.objectives import MethodHooks

if TYPE_CHECKING:
    from edgefcl.learn.client import Client

LOCAL = ("mask", "adaptive", "alpha")
"""Per-layer parameters that stay on the client."""
MAX_PAST = 10
"""Past tasks whose weights the retroactive term keeps."""


class APCLayer(nn.Module):
    """A Linear or Conv2d layer with the decomposed weight B ⊙ sigmoid(m) + A + alpha · KB."""

    def __init__(self, layer: nn.Linear | nn.Conv2d) -> None:
        super().__init__()
        self.conv: dict | None = None
        if isinstance(layer, nn.Conv2d):
            if layer.padding_mode != "zeros":
                raise ConfigError("apc supports Conv2d layers with zero padding only")
            self.conv = {"stride": layer.stride, "padding": layer.padding,
                         "dilation": layer.dilation, "groups": layer.groups}
        w = layer.weight.detach()
        self.weight = nn.Parameter(w.clone())
        if layer.bias is not None:
            self.bias = nn.Parameter(layer.bias.detach().clone())
        else:
            self.register_parameter("bias", None)
        self.mask = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device))
        self.adaptive = nn.Parameter(torch.zeros_like(w))
        self.alpha = nn.Parameter(torch.zeros(0, dtype=w.dtype, device=w.device))
        self.register_buffer("kb", torch.zeros((0, *w.shape), dtype=w.dtype, device=w.device),
                             persistent=False)
        self.past: list[tuple[Tensor, Tensor]] = []  # (mask logits m(i), theta(i))

    def _unit_shape(self) -> tuple[int, ...]:
        return (-1,) + (1,) * (self.weight.dim() - 1)

    def composed(self) -> Tensor:
        """The weight the layer computes with."""
        w = self.weight * torch.sigmoid(self.mask).view(self._unit_shape()) + self.adaptive
        if self.kb.shape[0]:
            w = w + torch.tensordot(self.alpha, self.kb, dims=1)
        return w

    def forward(self, x: Tensor) -> Tensor:
        w = self.composed()
        if self.conv is None:
            return F.linear(x, w, self.bias)
        return F.conv2d(x, w, self.bias, **self.conv)

    def init_kb(self, size: int) -> nn.Parameter:
        """Allocate the attention and the knowledge-base buffer for `size` slots."""
        w = self.weight
        self.alpha = nn.Parameter(torch.zeros(size, dtype=w.dtype, device=w.device))
        self.kb = torch.zeros((size, *w.shape), dtype=w.dtype, device=w.device)
        return self.alpha

    @torch.no_grad()
    def load_kb(self, kb: np.ndarray) -> None:
        """Copy the global knowledge base (slots beyond the local size are ignored)."""
        n = min(len(kb), self.kb.shape[0])
        self.kb[:n].copy_(torch.from_numpy(np.asarray(kb[:n])).to(self.kb))

    def retro(self, prune: float) -> Tensor:
        """sum_i ||B ⊙ sigmoid(m(i)) + A(i) - theta(i)||^2 with A(i) in closed form."""
        total = self.weight.new_zeros(())
        for m, theta in self.past:
            d = self.weight * torch.sigmoid(m).view(self._unit_shape()) - theta
            kept = (d.detach().abs() < prune).to(d.dtype)  # entries where A(i) is pruned to 0
            total = total + (d * kept).square().sum()
        return total

    @torch.no_grad()
    def past_adaptive(self, i: int, prune: float) -> Tensor:
        """A(i) for the current base (what the retroactive term solves for)."""
        m, theta = self.past[i]
        a = theta - self.weight * torch.sigmoid(m).view(self._unit_shape())
        return torch.where(a.abs() >= prune, a, torch.zeros_like(a))

    @torch.no_grad()
    def finish_task(self, prune: float) -> np.ndarray:
        """Store the task's mask and weights, return its pruned A, start a fresh A and alpha."""
        self.past.append((self.mask.detach().clone(), self.composed().detach().clone()))
        del self.past[:-MAX_PAST]
        a = self.adaptive.detach().to("cpu", torch.float32).numpy().copy()
        a[np.abs(a) < prune] = 0.0
        self.adaptive.zero_()
        self.alpha.zero_()
        return a

    def sent_rows(self, fraction: float) -> np.ndarray:
        """Sorted output units whose B rows are sent: the `fraction` with the largest mask."""
        m = self.mask.detach().to("cpu", torch.float32).numpy()
        k = min(m.size, max(1, math.ceil(fraction * m.size)))
        return np.sort(np.argsort(-m, kind="stable")[:k])


def decompose(model: nn.Module) -> nn.Module:
    """Replace every Linear and Conv2d of `model` by an APCLayer (in place); returns it.
    Decomposing an already decomposed model changes nothing."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Conv2d))]
    if not targets and not apc_layers(model):
        raise ConfigError("apc found no Linear or Conv2d layer to decompose")
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, APCLayer(m))
    return model


def apc_layers(model: nn.Module) -> dict[str, APCLayer]:
    """State key of each decomposed layer's base weight -> the layer."""
    return {f"{n}.weight" if n else "weight": m for n, m in model.named_modules()
            if isinstance(m, APCLayer)}


def local_keys(model: nn.Module) -> frozenset[str]:
    """State keys of the local m, A and alpha of the model's APC layers."""
    return frozenset(f"{k[:-len('weight')]}{n}" for k in apc_layers(model) for n in LOCAL)


def shared_tensors(model: nn.Module, tensors: Tensors) -> Tensors:
    """`tensors` (the model's state) without the local parameters: what the global holds."""
    local = local_keys(model)
    return {k: v for k, v in tensors.items() if k not in local}


class APC(MethodHooks):
    """Method `apc`: decomposed layers, L1 + retroactive penalty, task bookkeeping, and the
    update payload (see the module docstring)."""

    def __init__(self, learn: LearnConfig) -> None:
        self.l1, self.l2 = learn.apc_l1, learn.apc_l2
        self.prune, self.send = learn.apc_prune, learn.apc_send
        self.layers: dict[str, APCLayer] = {}
        self.local_keys: frozenset[str] = frozenset()
        self.pending_kb: dict[str, np.ndarray] | None = None
        self.kb_sent = False
        self.started = False
        self.value_dtype = "float32"

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return decompose(model)

    def attach(self, client: Client) -> None:
        if not isinstance(client.encoder, APCEncoder):
            raise ConfigError("method apc needs --encoding apc (config.for_method sets it)")
        self.layers = apc_layers(client.model)
        self.local_keys = local_keys(client.model)
        size = client.fed.apc_kb_size
        alphas = [layer.init_kb(size) for layer in self.layers.values()]
        if size > 0:
            client.opt.add_param_group({"params": alphas})
        self.value_dtype = client.fed.value_dtype
        client.encoder.bind(self)

    def penalty(self, client: Client) -> Tensor:
        terms = []
        for layer in self.layers.values():
            terms.append(self.l1 * (torch.sigmoid(layer.mask).sum() + layer.adaptive.abs().sum()))
            if layer.past:
                terms.append(0.5 * self.l2 * layer.retro(self.prune))
        return torch.stack(terms).sum()

    def on_task_start(self, client: Client, task: int) -> None:
        if self.started:
            kb = {}
            for name, layer in self.layers.items():
                kb[name] = layer.finish_task(self.prune)
                for p in (layer.adaptive, layer.alpha):
                    client.opt.state.pop(p, None)  # fresh Adam moments for the new task
            self.pending_kb, self.kb_sent = kb, False
        self.started = True

    def on_global(self, client: Client, g: GlobalModel) -> None:
        if self.kb_sent:
            self.pending_kb, self.kb_sent = None, False
        for name, layer in self.layers.items():
            kb = g.tensors.get(name + KB)
            if kb is not None:
                layer.load_kb(kb)

    def payload(self, current: Tensors) -> Tensors:
        """The update payload for the model state `current`."""
        out: Tensors = {}
        for k, t in current.items():
            if k in self.local_keys:
                continue
            layer = self.layers.get(k)
            if layer is None:
                out[k] = t
                continue
            rows = layer.sent_rows(self.send)
            out[k + ROWS] = encode_indices(rows)
            out[k + VAL] = to_values(t.reshape(t.shape[0], -1)[rows].ravel(), self.value_dtype)
        if self.pending_kb is not None:
            for k, a in self.pending_kb.items():
                nz = np.flatnonzero(a)
                out[k + KB + IDX] = encode_indices(nz)
                out[k + KB + VAL] = to_values(a.ravel()[nz], self.value_dtype)
            self.kb_sent = True
        return out
