"""Update encodings: the `Encoding` descriptor (everything about one encoding, both sides of
the wire) and the plain `dense` encoding. The registry of encodings is
`edgefcl.federation.registry.ENCODINGS`.

A client-side `Encoder` has
- `name`: the encoding's name (sent in every Update);
- `encode(current, base) -> Tensors`: the payload for the model state `current`, given the state
  `base` of the last global the client merged;
- `decode_global(tensors, current) -> Tensors`: model state to load from a global payload.
Encoders may keep state between rounds (error feedback); they must not import the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from edgefcl.config import ConfigError, FedConfig
from edgefcl.federation.messages import Checked, Tensors
from edgefcl.federation.rules import DENSE_RULES
from edgefcl.federation.strategy import Spec, Strategy, check_dense


class Encoder(Protocol):
    """The client side of an encoding."""

    name: str

    def encode(self, current: Tensors, base: Tensors) -> Tensors: ...

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors: ...


def same(tensors: Tensors) -> Tensors:
    """The identity on payloads (most encodings need no server-side decoding)."""
    return tensors


@dataclass(frozen=True)
class Encoding:
    """Everything about one update encoding."""

    name: str
    help: str
    """One line for `--help` and error messages."""
    make_encoder: Callable[[FedConfig], Encoder]
    """The client's encoder, with the options it reads from the config."""
    validate: Callable[[Tensors, Spec], str | None]
    """Reason to reject an update payload against the global spec (never raises)."""
    rules: Mapping[str, type[Strategy]]
    """Aggregation name -> the Strategy that aggregates this encoding's (decoded) updates."""
    decode: Callable[[Tensors], Tensors] = same
    """Server side, after `validate`: the payload as the rules read it (`form`)."""
    check: Callable[[Tensors, Spec], tuple[str | None, Checked | None]] | None = None
    """`validate` that also returns what it decoded, for the rule to reuse (`Update.checked`;
    None: `validate` alone)."""
    form: str = "dense"
    """What `decode` yields: dense (whole float32 tensors), sparse (entries' changes on a
    base), entries (entries' absolute values: apc) or gaussian (mu/sigma pairs); robust rules
    pick what they apply to from it."""
    initial: Callable[[Tensors], Tensors] = same
    """The model's federated state -> the first global (its names as globals carry them)."""
    downlink: str = "dense"
    """What `--downlink auto` sends this encoding's clients: dense (whole) or sparse (deltas)."""
    sparse_downlink: bool = True
    """Whether `--downlink sparse` works with it."""
    bayesian: bool = False
    """The client's model is made Bayesian (posterior scores are available)."""
    method: str = ""
    """The one method that produces this encoding, if it needs one (apc)."""
    default_rule: str = "fedavg"
    """The aggregation a method that implies this encoding gets when none is given."""
    knowledge_base: bool = False
    """Its globals also carry a knowledge base of `apc_kb_size` models' worth of tensors (the
    payload limit grows with it)."""
    value_dtypes: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
    """The `value_dtype`s it can send."""
    exportable: bool = False
    """Its global tensors are the model's own state (an operator can export them as they
    are: `runtime/fleet_results.py`)."""

    def checked(self, tensors: Tensors, spec: Spec) -> tuple[str | None, Checked | None]:
        """(the reason to reject `tensors`, or None; what validating them decoded, or None)."""
        if self.check is None:
            return self.validate(tensors, spec), None
        return self.check(tensors, spec)

    def strategy(self, aggregation: str, fed: FedConfig, spec: Spec) -> Strategy:
        """The run's long-lived strategy for `aggregation`; ConfigError for an unknown one."""
        rule = self.rules.get(aggregation)
        if rule is None:
            raise ConfigError(f"unknown aggregation '{aggregation}' for encoding '{self.name}'; "
                              f"choose from {', '.join(self.rules)}")
        return rule(fed, spec)


class DenseEncoder:
    """All federated tensors, as they are."""

    name = "dense"

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        return current

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        return tensors


DENSE = Encoding(
    name="dense",
    help="every federated tensor as float32",
    make_encoder=lambda fed: DenseEncoder(),
    validate=check_dense,
    rules=DENSE_RULES,
    exportable=True,
)
