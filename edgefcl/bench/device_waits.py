"""Where a client's loop would wait for its device: every read of a tensor's value on the
host (`item`, `bool`, `int`), every op whose output size depends on values (`nonzero`,
`equal`) and every `Tensor.numpy`, counted per mini-batch and by the line of edgefcl that
asked. On CUDA each one stalls the host until the device's queue drains; on CPU none waits,
but the same code runs, so the count is the same profile. Values drawn from a CPU generator
(the augmentation and view seeds) never wait on any device and are not counted.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgefcl.build import make_client, prepare
from edgefcl.config import RunConfig
from edgefcl.data.workload import client_stream

WAITS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero"})
"""aten ops that need a tensor's values on the host."""
PACKAGE = Path(__file__).resolve().parents[1]
THIS = str(Path(__file__).resolve())


def _site() -> str:
    """The innermost line of edgefcl (outside this module) on the stack."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(str(PACKAGE)) and frame.filename != THIS:
            return f"{Path(frame.filename).relative_to(PACKAGE).as_posix()}:{frame.lineno}"
    return "(outside edgefcl)"


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._drawn: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # from CPU generators

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in WAITS and not (args and isinstance(args[0], torch.Tensor)
                                  and args[0] in self._drawn):
            self.sites[f"{name} {_site()}"] += 1
        out = func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu" and isinstance(
                out, torch.Tensor):
            self._drawn.add(out)
        return out


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count the device waits inside the block, by op and line (the Counter it yields)."""
    counter = _Counter()
    numpy = torch.Tensor.numpy

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.sites[f"numpy {_site()}"] += 1
        return numpy(t, *args, **kwargs)

    torch.Tensor.numpy = counted  # type: ignore[method-assign]
    try:
        with counter:
            yield counter.sites
    finally:
        torch.Tensor.numpy = numpy  # type: ignore[method-assign]


def device_waits(cfg: RunConfig, method: str, batches: int = 200) -> dict[str, Any]:
    """Client 0 of `cfg` (method `method`) learning up to `batches` mini-batches of its
    stream: device waits per mini-batch, in all and by line."""
    setup = prepare(cfg, cfg.seed)
    client = make_client(cfg, setup, 0, method, cfg.seed)
    n = 0
    with counting() as sites:
        for batch in client_stream(cfg, setup.tasks[0], 0, cfg.seed):
            client.step(batch)
            n += 1
            if n >= batches:
                break
    n = max(n, 1)
    return {"method": method, "batches": n, "per_batch": sum(sites.values()) / n,
            "sites": {k: v / n for k, v in sites.most_common()}}


def print_waits(rows: list[dict[str, Any]], top: int = 6) -> None:
    """A table per method: waits per mini-batch, then the lines that ask most."""
    print("\ndevice waits per client mini-batch (host reads of device values; on CPU "
          "counted, not waited)")
    for r in rows:
        print(f"  {r['method']:<8} {r['per_batch']:6.2f}  over {r['batches']} mini-batches")
        for site, k in list(r["sites"].items())[:top]:
            print(f"           {k:6.2f}  {site}")
