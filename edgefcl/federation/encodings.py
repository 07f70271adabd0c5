"""Client-side update encodings: what a client puts in an Update and how it reads a global.

`make_encoder(name)` returns an encoder with
- `encode(current, base) -> Tensors`: the payload for the model state `current`, given the state
  `base` of the last global the client merged;
- `decode_global(tensors, current) -> Tensors`: model state to load from a global payload.
Encoders may keep state between rounds (error feedback); they must not import the transport.
"""

from __future__ import annotations

from collections.abc import Callable

from edgefcl.federation.messages import Tensors


class DenseEncoder:
    """All federated tensors, as they are."""

    name = "dense"

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        return current

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        return tensors


ENCODERS: dict[str, Callable[..., object]] = {"dense": DenseEncoder}


def make_encoder(name: str, **options):
    """The client-side encoder for encoding `name`."""
    try:
        return ENCODERS[name](**options)
    except KeyError:
        raise ValueError(f"unknown encoding '{name}'; choose from {', '.join(ENCODERS)}") from None
