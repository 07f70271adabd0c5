"""Memory selection rules, one per file, registered by name (see `base`)."""

from edgefcl.learn.selection import bottom, kcenter, mix, step, top  # noqa: F401 (register)
from edgefcl.learn.selection.base import (
    SELECTIONS,
    Candidates,
    Selection,
    get_selection,
    grouped_rank,
    register,
)

__all__ = ["SELECTIONS", "Candidates", "Selection", "get_selection", "grouped_rank", "register"]
