"""step: keep evenly spaced uncertainty ranks of a class (a stratified sample over the
uncertainty ranking, from the least to the most uncertain; close to Rainbow Memory's
diversity-aware sampling)."""

import torch
from torch import Tensor

from edgefcl.learn.selection.selection_rule import Candidates, Selection, grouped_rank


class Step(Selection):
    name = "step"

    def select(self, c: Candidates) -> Tensor:
        rank = grouped_rank(c.cls, c.score, c.counts)
        k, cnt = c.keep[c.cls], c.counts[c.cls]
        # rank r of cnt is kept iff floor(r * k / cnt) steps up at r: k evenly spaced ranks,
        # the first (least uncertain) always among them.
        return torch.remainder(rank * k, cnt) < k
