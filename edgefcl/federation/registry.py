"""The registry of update encodings: one line per encoding, each an `Encoding` descriptor
(`edgefcl.federation.encodings`) defined in the encoding's own module. Everything that acts on
an encoding name (config checks, client encoder, aggregator validation and strategy, first
global, downlink) asks here."""

from __future__ import annotations

from edgefcl.config import NAMES, ConfigError, FedConfig
from edgefcl.federation.apc_rule import APC
from edgefcl.federation.encodings import DENSE, Encoding
from edgefcl.federation.gaussian import GAUSSIAN
from edgefcl.federation.q8 import Q8
from edgefcl.federation.sparse import SPARSE
from edgefcl.federation.strategy import Strategy

ENCODINGS: dict[str, Encoding] = {e.name: e for e in (
    DENSE,
    SPARSE,
    GAUSSIAN,
    APC,
    Q8,
)}

NAMES["encodings"] = ENCODINGS  # what configs check encoding and rule names against


def get_rule(fed: FedConfig) -> type[Strategy]:
    """The aggregation rule class of `fed` (its encoding's rule `fed.aggregation`)."""
    enc = get_encoding(fed.encoding)
    rule = enc.rules.get(fed.aggregation)
    if rule is None:
        raise ConfigError(f"unknown aggregation '{fed.aggregation}' for encoding '{enc.name}'; "
                          f"choose from {', '.join(enc.rules)}")
    return rule


def get_encoding(name: str) -> Encoding:
    """The descriptor of encoding `name`; ConfigError listing the encodings otherwise."""
    enc = ENCODINGS.get(name)
    if enc is None:
        raise ConfigError(f"unknown encoding '{name}'; choose from {', '.join(ENCODINGS)}")
    return enc
