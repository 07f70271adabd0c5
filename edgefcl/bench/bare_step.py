"""Bare-step references of `edgefcl bench client`: what one client's training of a mini-batch
costs in torch alone, and what stacking the clients of a tick into one computation could gain.

Each variant runs `local_epochs` optimizer steps of the run's initial model on 2 x batch_size
samples of the first task (the batch and a replay draw of the same size), on the run's device,
timed after a warm-up:

- `eager`: the model with torch.optim's optimizer of the client's kind, its default
  implementation;
- `fused`: the model and optimizer as the client builds them (`learn/optimizers.py`: Adam by
  torch's fused kernel; skipped where torch has none for the device);
- `compiled`: the client's step as `--compile-step on` runs it (`learn/compiled_step.py`: the
  loss compiled by `torch.compile`, mode reduce-overhead with CUDA graphs on CUDA, and the
  client's own optimizer); its compile time is reported apart;
- `stacked`: `clients` copies of the model stepped as one computation, as `--batch-clients`
  steps them (`learn/batched.FleetTrainer.train_stacked`: parameters and BatchNorm
  statistics stacked, one forward (batched matrix products for the MLP, else `torch.func.vmap`)
  and one backward, the fused Adam kernel over every client's state); the time per client is
  reported; with `compile_step`, also with the stacked step compiled as `--compile-step on`
  compiles it (`stacked_compiled`), its compile time apart.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from edgefcl.build import Setup, make_optimizer
from edgefcl.config import RunConfig
from edgefcl.learn.batched import FleetTrainer, architecture_of
from edgefcl.learn.compiled_step import (
    CompiledLoss,
    Loss,
    graphs_compiled,
    plain_loss,
    stacked_loss,
)
from edgefcl.learn.learner import resolve_device
from edgefcl.learn.optimizers import LocalOptimizer


def _timed(step: Callable[[], None], seconds: float, sync: Callable[[], None],
           warmup: int = 10) -> float:
    """Mean ms of `step` over `seconds` (at least one call), after `warmup` calls."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    n = 0
    while True:
        step()
        n += 1
        sync()
        if (elapsed := time.perf_counter() - t0) >= seconds:
            return 1000 * elapsed / n


def _stepper(model: nn.Module, opt: torch.optim.Optimizer | LocalOptimizer, x: torch.Tensor,
             y: torch.Tensor, steps: int, loss_of: Loss = plain_loss) -> Callable[[], None]:

    def step() -> None:
        for _ in range(steps):
            loss = loss_of(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return step


def _torch_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """torch.optim's own optimizer of the client's kind and learning rate, its default
    implementation."""
    kinds = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    return kinds[cfg.learn.optimizer](model.parameters(), lr=cfg.learn.lr)


def bare_step_refs(cfg: RunConfig, setup: Setup, seconds: float = 2.0, clients: int = 0,
                   compile_step: bool = True) -> dict:
    """ms per client mini-batch of each variant (see the module docstring), with the compile
    time of `compiled` and the number of stacked clients (`clients`, default the run's)."""
    device = resolve_device(cfg.learn.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    task = setup.tasks[0][0]
    n = 2 * cfg.data.batch_size
    x = torch.from_numpy(task.x_train[:n]).to(device)
    y = torch.from_numpy(task.y_train[:n]).long().to(device)
    steps = cfg.learn.local_epochs
    out: dict = {"samples": n, "steps": steps, "device": str(device)}

    def fresh() -> nn.Module:
        return copy.deepcopy(setup.initial).to(device).train()

    model = fresh()
    out["eager_ms"] = _timed(_stepper(model, _torch_optimizer(model, cfg), x, y, steps),
                             seconds, sync)
    model = fresh()
    try:
        opt = make_optimizer(model, cfg.learn)
        out["fused_ms"] = _timed(_stepper(model, opt, x, y, steps), seconds, sync)
    except (RuntimeError, TypeError, ValueError) as e:  # no fused kernel for this device
        out["fused_skipped"] = str(e).splitlines()[0][:200]
    if compile_step:
        model = fresh()
        timings: Counter[str] = Counter()
        loss = CompiledLoss(device, timings, min_uses=1)
        step = _stepper(model, make_optimizer(model, cfg.learn), x, y, steps, loss)
        graphs = graphs_compiled()
        step()
        if loss.compiled_steps:
            # None: compiled earlier in this process (a run of `bench client` before)
            out["compile_s"] = timings["compile"] if graphs_compiled() > graphs else None
            out["compiled_ms"] = _timed(step, seconds, sync)
        else:  # the compiler failed (the log says why): the step ran eager
            out["compiled_skipped"] = "torch.compile made no graph; see the log"
    k = clients or cfg.fed.clients
    out["stacked_clients"] = k
    models = [fresh() for _ in range(k)]
    opts = [make_optimizer(m, cfg.learn) for m in models]
    trainer = FleetTrainer()
    inputs = [[(x, y)] * steps for _ in range(k)]
    arch = architecture_of(models[0])  # once, not in every timed call
    out["stacked_ms_per_client"] = _timed(
        lambda: trainer.train_stacked(models, opts, inputs, arch), seconds, sync) / k
    if compile_step:
        timings = Counter()
        stacked = CompiledLoss(device, timings, min_uses=1, fn=stacked_loss)
        graphs = graphs_compiled()
        trainer.train_stacked(models, opts, inputs, arch, stacked)  # compiles
        if stacked.compiled_steps:
            out["stacked_compile_s"] = timings["compile"] if graphs_compiled() > graphs else None
            out["stacked_compiled_ms_per_client"] = _timed(
                lambda: trainer.train_stacked(models, opts, inputs, arch, stacked),
                seconds, sync) / k
        else:
            out["stacked_compiled_skipped"] = "torch.compile failed or made no graph; see the log"
    return out


def print_refs(refs: dict) -> None:
    """One line per variant."""
    print(f"\nbare step ({refs['steps']} steps on {refs['samples']} samples, {refs['device']}), "
          "ms per client mini-batch:")
    print(f"  eager {refs['eager_ms']:.2f}")
    for key, label in (("fused", "fused optimizer"), ("compiled", "torch.compile")):
        if f"{key}_ms" in refs:
            extra = "" if key != "compiled" else (
                " (compiled earlier in this process)" if refs["compile_s"] is None
                else f" (compile {refs['compile_s']:.1f} s)")
            print(f"  {label} {refs[f'{key}_ms']:.2f}{extra}")
        elif f"{key}_skipped" in refs:
            print(f"  {label}: skipped ({refs[f'{key}_skipped']})")
    for key, label in (("stacked", "stacked (--batch-clients)"),
                       ("stacked_compiled", "stacked and compiled")):
        k = refs["stacked_clients"]
        if f"{key}_ms_per_client" in refs:
            ms = refs[f"{key}_ms_per_client"]
            extra = "" if key == "stacked" else (
                ", compiled earlier in this process" if refs["stacked_compile_s"] is None
                else f", compile {refs['stacked_compile_s']:.1f} s")
            print(f"  {k} clients {label} {ms:.2f} per client "
                  f"({refs['eager_ms'] / ms:.2f}x eager{extra})")
        elif f"{key}_skipped" in refs:
            print(f"  {k} clients {label}: skipped ({refs[f'{key}_skipped']})")
