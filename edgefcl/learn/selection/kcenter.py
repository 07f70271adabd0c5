"""kcenter: a diverse allotment in feature space. Within every class, greedy farthest-first
traversal (the 2-approximation of k-center) on the penultimate features of the scoring model,
starting from the candidate nearest the class mean. Needs no uncertainty scores."""

import torch
from torch import Tensor

from edgefcl.learn.selection.selection_rule import (
    Candidates,
    FeatureSelection,
    class_means,
    greedy_per_class,
)


class KCenter(FeatureSelection):
    name = "kcenter"

    def select(self, c: Candidates) -> Tensor:
        f = self.features(c)
        n, m = f.shape[0], c.counts.numel()
        # distance to the nearest kept candidate; before the first pick, to the class mean
        # negated (so the first pick is the candidate nearest the mean)
        dist = -(f - class_means(c, f)[c.cls]).norm(dim=1)

        def picked(picks: Tensor, taken: Tensor) -> None:
            new_of_class = torch.full((m,), -1, dtype=torch.int64, device=f.device)
            new_of_class[c.cls[picks]] = picks
            p = new_of_class[c.cls]
            has = p >= 0
            new = torch.zeros(n, f.shape[1], device=f.device)
            new[has] = f[p[has]]
            gap = (f - new).norm(dim=1)
            fresh = taken[c.cls] == 1
            dist.copy_(torch.where(has, torch.where(fresh, gap, torch.minimum(dist, gap)), dist))

        return greedy_per_class(c, lambda taken: -dist, picked)
