"""top: keep the most uncertain candidates of a class."""

from torch import Tensor

from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank


class Top(Selection):
    name = "top"

    def select(self, c: Candidates) -> Tensor:
        return grouped_rank(c.cls, -c.score, c.counts) < c.keep[c.cls]
