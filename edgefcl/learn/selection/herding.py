"""herding: iCaRL's exemplar rule. Within every class, greedily add the candidate that keeps
the mean of the kept (L2-normalised) penultimate features closest to the class mean: a
representative allotment that still covers the class. Needs no uncertainty scores."""

import torch
from torch import Tensor

from edgefcl.learn.selection.selection_rule import (
    Candidates,
    FeatureSelection,
    class_means,
    greedy_per_class,
)


class Herding(FeatureSelection):
    name = "herding"

    def select(self, c: Candidates) -> Tensor:
        f = torch.nn.functional.normalize(self.features(c), dim=1)
        mean = class_means(c, f)
        total = torch.zeros_like(mean)  # sum of the kept features per class

        def cost(taken: Tensor) -> Tensor:  # distance of the kept mean, were it added
            t = (taken + 1).to(f.dtype)[c.cls].unsqueeze(1)
            return (mean[c.cls] - (total[c.cls] + f) / t).norm(dim=1)

        def picked(picks: Tensor, taken: Tensor) -> None:
            total.index_add_(0, c.cls[picks], f[picks])

        return greedy_per_class(c, cost, picked)
