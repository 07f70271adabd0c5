"""bottom: keep the least uncertain candidates of a class (the paper's best rule)."""

from torch import Tensor

from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank


class Bottom(Selection):
    name = "bottom"

    def select(self, c: Candidates) -> Tensor:
        return grouped_rank(c.cls, c.score, c.counts) < c.keep[c.cls]
