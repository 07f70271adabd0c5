"""The registry of classifier heads: one `Head` descriptor each, in `HEADS`. `--head auto` gives
a method its own (`Method.head`, `config.resolve_head`); the code that acts on a head asks its
descriptor (`library_head`), never its name."""

from __future__ import annotations

from dataclasses import dataclass

from edgefcl.config import NAMES, RunConfig, resolve_head


@dataclass(frozen=True)
class Head:
    """A classifier head."""

    name: str
    library: bool
    """Its classes are rows of a prototype library keyed by label name (labels travel as names,
    the library with updates and globals); False: an output layer indexed by class number."""
    help: str


HEADS: dict[str, Head] = {h.name: h for h in (
    Head("fixed", False, "an output layer sized from the dataset's classes"),
    Head("prototypes", True, "FedBNN's prototype library: rows keyed by label name"),
)}
NAMES["heads"] = HEADS  # what configs check head names against


def library_head(cfg: RunConfig) -> bool:
    """Whether a run of `cfg` keeps a prototype library (its head's `library`; an unknown head,
    which the config refuses, keeps none)."""
    head = HEADS.get(resolve_head(cfg.learn.head, cfg.learn.method))
    return head is not None and head.library
