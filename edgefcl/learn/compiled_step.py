"""The client's training loss compiled by `torch.compile` (`--compile-step`): on CUDA its
forward and backward are captured as CUDA graphs (mode reduce-overhead), which turns a step
bound by kernel launches into a few graph replays; on CPU inductor fuses the step's kernels.

Shapes stay static (`dynamic=False`): a step's shape is compiled once it has been trained on
`min_uses` times, for at most `max_shapes` shapes (a run has two: the first task's steps, with
no replay yet, and the later ones, batch plus replay draw). Any other step (a stream's last,
partial mini-batch, a replay draw that is not full yet) runs eager, and so does every step
after the compiler failed (no C++ toolchain, an unsupported model): it fails once, says so,
and the run goes on. The model is an argument of the compiled function, so clients of one
architecture share its compiled code, compiled once per process; the module itself is left
as it is (state-dict names, the scoring snapshot's ONNX export, the stacked path's
`functional_call`). The compile time goes to the learner's `timings["compile"]`, not to
`train`.

Only the plain loss of a fixed-head, non-Bayesian model is compiled: the prototype head
assembles its classifier per batch, and a Bayesian model samples its weights each step. Those
steps run eager (the learner says why once). A method's penalty is added outside, eagerly.

Measured (docs/speed.md): on this project's 2-core CPU the MNIST-1D MLP's step is slower
compiled (1.24 against 1.18 ms), the slim ResNet-18's faster (177 against 241 ms, after 39 s of
compiling), which pays back only after about 600 mini-batches; hence `auto` is on with CUDA
and off on CPU.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.config import LearnConfig

log = logging.getLogger(__name__)

Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]
"""(model, x, y) -> the step's loss, to back-propagate."""

_COMPILED: dict[str, Callable] = {}  # torch.compile mode -> the compiled plain loss
_SAID: set = set()  # reasons and compiled shapes already logged (once per process)


def compile_step(learn: LearnConfig) -> bool:
    """Whether a client's training loss is compiled: `learn.compile_step`, where auto means on
    with CUDA (CUDA graphs) and off on CPU (see the module docstring)."""
    if learn.compile_step == "auto":
        return torch.device(learn.device).type == "cuda"
    return learn.compile_step == "on"


def plain_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The cross-entropy of `model`'s outputs on `x` against the class numbers `y`."""
    return F.cross_entropy(model(x), y)


def say_once(reason: str) -> None:
    """Log why a step runs eager, once per process."""
    if reason not in _SAID:
        _SAID.add(reason)
        log.warning("compile-step: %s; those steps run eager", reason)


def _compiled(mode: str) -> Callable:
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(plain_loss, mode=mode, dynamic=False)
    return _COMPILED[mode]


class CompiledLoss:
    """`plain_loss`, compiled for each of the first `max_shapes` step shapes trained on
    `min_uses` times, eager otherwise (see the module docstring). `timings["compile"]` gets
    the seconds of each compiling call (its step included); `compiled_steps` and
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
        self.failed = False
        self.compiled_steps = 0
        self.eager_steps = 0

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The step's loss: compiled for a steady shape, eager for any other."""
        shape = (tuple(x.shape), x.dtype, tuple(y.shape))
        if shape in self.shapes:
            return self._replay(model, x, y)
        if not self.failed and len(self.shapes) < self.max_shapes:
            self.uses[shape] += 1
            if self.uses[shape] >= self.min_uses:
                return self._first(shape, model, x, y)
        self.eager_steps += 1
        return plain_loss(model, x, y)

    def _replay(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        if self.cuda:  # a new step: the graphs' outputs of the last one are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        self.compiled_steps += 1
        return _compiled(self.mode)(model, x, y)

    def _first(self, shape: tuple, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """Compile `shape` (its first compiled step); on failure, every step runs eager."""
        t0, steps = time.perf_counter(), self.compiled_steps
        try:
            # a throw-away step of a copy compiles the forward and the backward (compiled
            # lazily, at its first call), so neither counts as the model's training
            _compiled(self.mode)(copy.deepcopy(model), x, y).backward()
            loss = self._replay(model, x, y)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001  (no toolchain, an unsupported op: eager instead)
            self.failed = True
            self.compiled_steps = steps
            say_once(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            self.eager_steps += 1
            return plain_loss(model, x, y)
        finally:
            seconds = time.perf_counter() - t0
            self.timings["compile"] += seconds
        self.shapes.add(shape)
        if (self.mode, shape) not in _SAID:  # the first compile in this process, not a cache hit
            _SAID.add((self.mode, shape))
            log.info("compile-step: compiled the step on %s samples in %.1f s", shape[0][0],
                     seconds)
        return loss
