"""Memory selection rules, one per file; the registry `SELECTIONS` lists them (one line each)."""

from edgefcl.config import ConfigError
from edgefcl.learn.selection.bottom import Bottom
from edgefcl.learn.selection.herding import Herding
from edgefcl.learn.selection.kcenter import KCenter
from edgefcl.learn.selection.mix import Mix
from edgefcl.learn.selection.random import Random
from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank
from edgefcl.learn.selection.step import Step
from edgefcl.learn.selection.top import Top

SELECTIONS: dict[str, Selection] = {r.name: r for r in (
    Bottom(),
    Top(),
    Step(),
    Mix(),
    KCenter(),
    Herding(),
    Random(),
)}
"""Rule name -> rule."""


def get_selection(name: str) -> Selection:
    """The rule called `name`, or a ConfigError listing the known ones."""
    rule = SELECTIONS.get(name)
    if rule is None:
        raise ConfigError(f"unknown selection '{name}'; choose from {', '.join(SELECTIONS)}")
    return rule


__all__ = ["SELECTIONS", "Candidates", "Selection", "get_selection", "grouped_rank"]
