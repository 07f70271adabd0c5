"""The tensors of a model as they travel in a global: what the aggregator starts from and
what a device expects every global to look like (names, shapes, dtypes)."""

from __future__ import annotations

from torch import nn

from edgefcl.federation.gaussian import to_wire
from edgefcl.federation.messages import Tensors
from edgefcl.learn.apc import shared_tensors
from edgefcl.learn.params import get_tensors


def global_tensors(model: nn.Module, encoding: str) -> Tensors:
    """`model`'s federated tensors named like a global of `encoding` (gaussian: W::mu and
    W::sigma; apc: without the decomposed layers' local parts)."""
    tensors = get_tensors(model)
    if encoding == "apc":
        return shared_tensors(model, tensors)
    return to_wire(tensors) if encoding == "gaussian" else tensors
