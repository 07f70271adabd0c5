"""Memory selection rules, one per file, registered by name (see `base`)."""

from edgefcl.learn.selection import (  # noqa: F401 (register the rules)
    bottom,
    herding,
    kcenter,
    mix,
    step,
    top,
)
from edgefcl.learn.selection.base import (
    SELECTIONS,
    Candidates,
    Selection,
    get_selection,
    grouped_rank,
    register,
)

__all__ = ["SELECTIONS", "Candidates", "Selection", "get_selection", "grouped_rank", "register"]
