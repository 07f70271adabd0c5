"""The clients' local optimizers: Adam and SGD computed by torch's own kernels (the fused Adam
kernel `torch.optim.Adam(fused=True)` runs, SGD's `p -= lr * grad`), so a step gives the same
bits as torch.optim's.

Why not torch.optim itself: its optimizers wrap `step`, `zero_grad` and `add_param_group` in
torch's compiler guards, whose first call imports the compiler stack (`torch._dynamo`, sympy:
2.4-3 s on the 2-core CI machine). Every client process paid that at its first optimizer,
about a quarter of the in-process demo. These classes keep torch.optim's interface where the
learner, the method hooks and checkpoints use it (`param_groups`, `state`, `add_param_group`,
`zero_grad`, `step`, `state_dict`, `load_state_dict`) and its state-dict format, so
checkpoints written with torch.optim load here and the other way round.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


class LocalOptimizer:
    """What the two optimizers share: parameter groups, per-parameter state, state dicts."""

    defaults: dict[str, Any] = {}

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.defaults = {**type(self).defaults, "lr": lr}
        self.param_groups: list[dict[str, Any]] = []
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self.add_param_group({"params": list(params)})

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add parameters, with the defaults for any setting the group does not give."""
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        self.param_groups.append({**self.defaults, **group, "params": params})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: state by parameter index, groups with their indices."""
        index: dict[Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            ids = [index.setdefault(p, len(index)) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[p]: s for p, s in self.state.items() if p in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` (also torch.optim's) of an optimizer over the same
        parameters; the state tensors move to each parameter's device."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("optimizer state of different parameter groups")
        by_id = {i: p for saved, group in zip(groups, self.param_groups, strict=True)
                 for i, p in zip(saved["params"], group["params"], strict=True)}
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = defaultdict(dict)
        for i, s in state_dict["state"].items():
            p = by_id[int(i)]
            self.state[p] = {k: self._restore(v, p) for k, v in s.items()}

    @staticmethod
    def _restore(value: Any, p: Tensor) -> Any:
        if not isinstance(value, Tensor):
            return value
        if value.dim() == 0:  # the step count: float32 on the parameter's device (fused)
            return value.to(device=p.device, dtype=torch.float32)
        return value.to(device=p.device, dtype=p.dtype)

    def state_of(self, p: Tensor) -> dict[str, Any]:
        """`p`'s state, created as torch.optim creates it."""
        return self.state[p]

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self.apply(params, [p.grad for p in params], [self.state_of(p) for p in params],
                           group)

    @staticmethod
    def apply(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
              group: dict[str, Any]) -> None:
        """Update `params` in place from `grads` and their `states` with `group`'s settings,
        all in one call (the parameters may be rows of stacked tensors: `learn/batched.py`)."""
        raise NotImplementedError


class Adam(LocalOptimizer):
    """Adam (no amsgrad) with torch's fused kernel: the same update as
    `torch.optim.Adam(params, lr, fused=True)`, bit for bit."""

    defaults = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": True, "decoupled_weight_decay": False}

    def state_of(self, p: Tensor) -> dict[str, Any]:
        """`p`'s state (step, moments), created as torch's fused Adam creates it."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def apply(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
              group: dict[str, Any]) -> None:
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adam_(params, grads, [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False,
                           lr=group["lr"], beta1=beta1, beta2=beta2,
                           weight_decay=group["weight_decay"], eps=group["eps"],
                           maximize=group["maximize"])


class SGD(LocalOptimizer):
    """Plain SGD (no momentum): `p -= lr * grad`, as torch.optim.SGD."""

    defaults = {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                "maximize": False, "foreach": None, "differentiable": False, "fused": None}

    @staticmethod
    def apply(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
              group: dict[str, Any]) -> None:
        torch._foreach_add_(params, grads, alpha=-group["lr"])


OPTIMIZERS: dict[str, type[LocalOptimizer]] = {"adam": Adam, "sgd": SGD}
"""The `--optimizer` choices."""
