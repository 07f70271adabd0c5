"""mix: half of a class's allotment are its least uncertain candidates (rounded down), the
rest is drawn uniformly from the other candidates."""

import torch
from torch import Tensor

from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank


class Mix(Selection):
    name = "mix"
    low_fraction = 0.5

    def select(self, c: Candidates) -> Tensor:
        k = c.keep[c.cls]
        low = grouped_rank(c.cls, c.score, c.counts) < torch.div(
            k, round(1 / self.low_fraction), rounding_mode="floor")
        # the low ones sort first (key -1), the others in a random order
        u = c.uniform()
        return grouped_rank(c.cls, torch.where(low, -1.0, u), c.counts) < k
