"""The tensors of a model as they travel in a global: what the aggregator starts from and
what a device expects every global to look like (names, shapes, dtypes)."""

from __future__ import annotations

from torch import nn

from edgefcl.federation.messages import Tensors
from edgefcl.federation.registry import get_encoding
from edgefcl.learn.apc_layers import local_keys
from edgefcl.learn.params import get_tensors


def global_tensors(model: nn.Module, encoding: str) -> Tensors:
    """`model`'s federated tensors (without the local parameters of APC layers) named like a
    global of `encoding` (the descriptor's `initial`: gaussian gives W::mu and W::sigma)."""
    local = local_keys(model)
    shared = {k: v for k, v in get_tensors(model).items() if k not in local}
    return get_encoding(encoding).initial(shared)
