"""The client's training loss compiled by `torch.compile` (`--compile-step`, docs/speed.md):
on CUDA its forward and backward become CUDA graphs (mode reduce-overhead), for a step bound
by kernel launches; on CPU inductor fuses the step's kernels. `auto` is on with CUDA only (on
this project's CPUs the small models' steps measured slower compiled).

Shapes stay static (`dynamic=False`): a step shape is compiled once it has been trained on
`min_uses` times, for at most `max_shapes` shapes (a run has two: the first task's steps, with
no replay yet, and the later ones, batch plus replay draw). Any other step (a stream's last,
partial mini-batch, a replay draw that is not full yet) runs eager. The model is an argument of
the one compiled function, so clients of one architecture share its compiled code (compiled
once per process; on CUDA each client still records its own graphs, as the parameters are
fixed-address inputs), and the module itself is left as it is (state-dict names, the scoring
snapshot's ONNX export, the stacked path's `functional_call`). The compile time goes to the
learner's `timings["compile"]`, not to `train`.

When the compiler fails (no C++ toolchain, an unsupported model, torch's recompile limit), the
process says so once and every step of that loss runs eager from then on. Only the plain loss of a
fixed-head, non-Bayesian model is compiled (`step_loss`); a method's penalty is added eagerly.

The stacked step of `--batch-clients` (`learn/batched.py`) is compiled the same way
(`stacked_loss`: the stacked forward, BatchNorm statistics included, and the clients' summed
losses), with the same policy, when its clients' own steps are compiled.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import LearnConfig
from edgefcl.learn.bayes import is_bayesian

log = logging.getLogger(__name__)

Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]
"""(model, x, y) -> the step's loss, to back-propagate."""

PROTOTYPE_HEAD = "the prototype head assembles its classifier per batch"
"""Why a prototype-head client's step is neither compiled nor stacked."""
RECOMPILE_LIMIT = 64
"""torch's graphs per compiled function (its default, 8, is 4 architectures of 2 shapes: a
sweep of `--compare` over several models would silently run eager past it)."""

_COMPILED: dict[tuple[Callable, str], Callable] = {}  # (loss, torch.compile mode) -> compiled
_READY: set[tuple] = set()  # (mode, loss, architecture, shape) compiled
_BROKEN: set[tuple[Callable, str]] = set()  # (loss, mode) whose compile failed in the process
_SAID: set[str] = set()  # reasons already logged (once per process)


def compile_step(learn: LearnConfig) -> bool:
    """Whether a client's training loss is compiled: `learn.compile_step`, where auto means on
    with CUDA (CUDA graphs) and off on CPU."""
    if learn.compile_step == "auto":
        return torch.device(learn.device).type == "cuda"
    return learn.compile_step == "on"


def plain_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The cross-entropy of `model`'s outputs on `x` against the class numbers `y`."""
    return F.cross_entropy(model(x), y)


def stacked_loss(forward: Callable, params: dict[str, Tensor], buffers: dict[str, Tensor],
                 xs: Tensor, ys: Tensor) -> Tensor:
    """The sum over K stacked clients of each one's mean cross-entropy: `forward(params,
    buffers, xs)` gives the (K, N, C) logits of the clients' parameters and buffers (stacked
    along the first axis) on their samples `xs` (K, N, ...), against `ys` (K, N). Each client's
    gradient is its own."""
    logits = forward(params, buffers, xs)
    return F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum") / ys.shape[1]


def step_loss(model: nn.Module, prototypes: bool, compiled: bool, device: torch.device,
              timings: Counter[str]) -> Loss:
    """A fixed-head learner's loss: a `CompiledLoss` when `compiled` and the step allows it,
    else `plain_loss` (saying once why, at info level: these steps are eager by design)."""
    if not compiled:
        return plain_loss
    reason = (PROTOTYPE_HEAD if prototypes
              else "a Bayesian model samples its weights each step" if is_bayesian(model)
              else None)
    if reason is not None:
        _say(reason, logging.INFO)
        return plain_loss
    return CompiledLoss(device, timings)


def step_counts(losses: Iterable[Any]) -> dict[str, int]:
    """The compiled and eager steps of the `CompiledLoss`es among `losses` (none: {})."""
    compiled = [loss for loss in losses if isinstance(loss, CompiledLoss)]
    if not compiled:
        return {}
    return {"compiled_steps": sum(c.compiled_steps for c in compiled),
            "eager_steps": sum(c.eager_steps for c in compiled)}


def _say(reason: str, level: int = logging.WARNING) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        log.log(level, "compile-step: %s; those steps run eager", reason)


def _compiled(fn: Callable, mode: str) -> Callable:
    if (fn, mode) not in _COMPILED:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        _COMPILED[fn, mode] = torch.compile(fn, mode=mode, dynamic=False)
    return _COMPILED[fn, mode]


def _model_signature(args: tuple) -> str:
    model = args[0]
    return f"{type(model).__qualname__}:{model!r}"


def _model_throwaway(args: tuple) -> tuple:
    return copy.deepcopy(args[0]), *args[1:]


def _stacked_signature(args: tuple) -> str:
    return repr(args[0])  # the stacked forward: one per architecture and mode (batched.py)


def _stacked_throwaway(args: tuple) -> tuple:
    forward, params, buffers, xs, ys = args
    return (forward, {n: p.detach().clone().requires_grad_() for n, p in params.items()},
            {n: b.clone() for n, b in buffers.items()}, xs, ys)


_COPIES: dict[Callable, tuple[Callable[[tuple], str], Callable[[tuple], tuple]]] = {
    plain_loss: (_model_signature, _model_throwaway),
    stacked_loss: (_stacked_signature, _stacked_throwaway)}
"""Per compilable loss: what names its architecture, and the copy of its arguments that the
throw-away first step runs on (it must not move the clients' weights or statistics)."""


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class CompiledLoss:
    """`fn` (`plain_loss` or `stacked_loss`), compiled for each of the first `max_shapes` step
    shapes trained on `min_uses` times, eager otherwise (see the module docstring); its last
    two arguments are the samples and their labels. `timings["compile"]` gets the seconds of
    each shape's first compiled step (compiling included); `compiled_steps` and `eager_steps`
    count the steps of each kind."""

    def __init__(self, device: torch.device, timings: Counter[str], min_uses: int = 16,
                 max_shapes: int = 2, fn: Callable[..., Tensor] = plain_loss) -> None:
        self.fn = fn
        self.device = device
        self.cuda = device.type == "cuda"
        self.mode = "reduce-overhead" if self.cuda else "default"
        self.timings = timings
        self.min_uses = min_uses
        self.max_shapes = max_shapes
        self.uses: Counter[tuple] = Counter()
        self.shapes: set[tuple] = set()
        self.compiled_steps = 0
        self.eager_steps = 0

    def __call__(self, *args: Any) -> Tensor:
        """The step's loss: compiled for a steady shape, eager for any other."""
        if (self.fn, self.mode) not in _BROKEN:
            x, y = args[-2:]
            shape = (tuple(x.shape), x.dtype, tuple(y.shape))
            if shape in self.shapes:
                return self._replay(args)
            if len(self.shapes) < self.max_shapes:
                self.uses[shape] += 1
                if self.uses[shape] >= self.min_uses:
                    return self._first(shape, args)
        self.eager_steps += 1
        return self.fn(*args)

    def _replay(self, args: tuple) -> Tensor:
        if self.cuda:  # a new step: the graphs' outputs of the last one are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        try:
            loss = _compiled(self.fn, self.mode)(*args)
        except Exception as e:  # noqa: BLE001  (a graph that fails later: eager instead)
            return self._broken(e, args)
        self.compiled_steps += 1
        return loss

    def _first(self, shape: tuple, args: tuple) -> Tensor:
        """The first compiled step of `shape`: a throw-away step on a copy of the weights
        compiles the forward and the backward (compiled lazily, at its first call) unless this
        process did already, so that neither counts as training."""
        signature, throwaway = _COPIES[self.fn]
        key = (self.mode, self.fn, signature(args), shape)
        t0 = time.perf_counter()
        try:
            if key not in _READY:
                graphs = graphs_compiled()
                try:
                    _compiled(self.fn, self.mode)(*throwaway(args)).backward()
                except Exception as e:  # noqa: BLE001  (no toolchain, an unsupported op)
                    return self._broken(e, args)
                if graphs_compiled() == graphs:
                    return self._broken(None, args)
                _READY.add(key)
                log.info("compile-step: compiled the step on %s samples in %.1f s",
                         "x".join(map(str, shape[2])), time.perf_counter() - t0)
            self.shapes.add(shape)
            loss = self._replay(args)
            if self.cuda:  # this client's graphs recorded
                torch.cuda.synchronize(self.device)
            return loss
        finally:
            self.timings["compile"] += time.perf_counter() - t0

    def _broken(self, error: Exception | None, args: tuple) -> Tensor:
        """The compiler failed (`error`; None: it made no graph): every step of this loss in
        this process and mode runs eager from now on, this one included."""
        _BROKEN.add((self.fn, self.mode))
        _say("torch.compile made no graph (its recompile limit?)" if error is None else
             f"torch.compile failed ({type(error).__name__}: "
             f"{str(error).splitlines()[0][:160]})")
        self.eager_steps += 1
        return self.fn(*args)
