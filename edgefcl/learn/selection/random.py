"""random: keep a uniform draw of a class's candidates, ignoring scores and features.

The control of the study: the BI memory's pipeline with the ranking switched off, which keeps
the same memory, in distribution, as class-balanced random replay (`cbr`)."""

from torch import Tensor

from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank


class Random(Selection):
    name = "random"
    needs_scores = False

    def select(self, c: Candidates) -> Tensor:
        u = c.uniform()
        return grouped_rank(c.cls, u, c.counts) < c.keep[c.cls]
