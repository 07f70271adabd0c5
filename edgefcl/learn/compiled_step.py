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
process says so once and every step runs eager from then on. Only the plain loss of a
fixed-head, non-Bayesian model is compiled (`step_loss`); a method's penalty is added eagerly.
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

_COMPILED: dict[str, Callable] = {}  # torch.compile mode -> the compiled plain loss
_READY: set[tuple[str, str, tuple]] = set()  # (mode, architecture, shape) compiled
_BROKEN: set[str] = set()  # modes whose compiler failed in this process
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


def _compiled(mode: str) -> Callable:
    if mode not in _COMPILED:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        _COMPILED[mode] = torch.compile(plain_loss, mode=mode, dynamic=False)
    return _COMPILED[mode]


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class CompiledLoss:
    """`plain_loss`, compiled for each of the first `max_shapes` step shapes trained on
    `min_uses` times, eager otherwise (see the module docstring). `timings["compile"]` gets
    the seconds of each shape's first compiled step (compiling included); `compiled_steps` and
    `eager_steps` count the steps of each kind."""

    def __init__(self, device: torch.device, timings: Counter[str], min_uses: int = 16,
                 max_shapes: int = 2) -> None:
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

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The step's loss: compiled for a steady shape, eager for any other."""
        if self.mode not in _BROKEN:
            shape = (tuple(x.shape), x.dtype, tuple(y.shape))
            if shape in self.shapes:
                return self._replay(model, x, y)
            if len(self.shapes) < self.max_shapes:
                self.uses[shape] += 1
                if self.uses[shape] >= self.min_uses:
                    return self._first(shape, model, x, y)
        self.eager_steps += 1
        return plain_loss(model, x, y)

    def _replay(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        if self.cuda:  # a new step: the graphs' outputs of the last one are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        try:
            loss = _compiled(self.mode)(model, x, y)
        except Exception as e:  # noqa: BLE001  (a graph that fails later: eager instead)
            return self._broken(e, model, x, y)
        self.compiled_steps += 1
        return loss

    def _first(self, shape: tuple, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The first compiled step of `shape`: a throw-away step of a copy of the model
        compiles the forward and the backward (compiled lazily, at its first call) unless this
        process did already, so that neither counts as training."""
        key = (self.mode, f"{type(model).__qualname__}:{model!r}", shape)
        t0 = time.perf_counter()
        try:
            if key not in _READY:
                graphs = graphs_compiled()
                try:
                    _compiled(self.mode)(copy.deepcopy(model), x, y).backward()
                except Exception as e:  # noqa: BLE001  (no toolchain, an unsupported op)
                    return self._broken(e, model, x, y)
                if graphs_compiled() == graphs:
                    return self._broken(None, model, x, y)
                _READY.add(key)
                log.info("compile-step: compiled the step on %d samples in %.1f s", shape[0][0],
                         time.perf_counter() - t0)
            self.shapes.add(shape)
            loss = self._replay(model, x, y)
            if self.cuda:  # this client's graphs recorded
                torch.cuda.synchronize(self.device)
            return loss
        finally:
            self.timings["compile"] += time.perf_counter() - t0

    def _broken(self, error: Exception | None, model: nn.Module, x: Tensor, y: Tensor
                ) -> Tensor:
        """The compiler failed (`error`; None: it made no graph): every step of this process
        in this mode runs eager from now on, this one included."""
        _BROKEN.add(self.mode)
        _say("torch.compile made no graph (its recompile limit?)" if error is None else
             f"torch.compile failed ({type(error).__name__}: "
             f"{str(error).splitlines()[0][:160]})")
        self.eager_steps += 1
        return plain_loss(model, x, y)
