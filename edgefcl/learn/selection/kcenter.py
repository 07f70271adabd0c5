"""kcenter: a diverse allotment in feature space. Within every class, greedy farthest-first
traversal (the 2-approximation of k-center) on the penultimate features of the scoring model,
starting from the candidate nearest the class mean. Needs no uncertainty scores."""

import torch
from torch import Tensor

from edgefcl.learn.selection.base import Candidates, Selection, register


@register
class KCenter(Selection):
    name = "kcenter"
    needs_scores = False
    needs_features = True

    def select(self, c: Candidates) -> Tensor:
        if c.features is None:
            raise ValueError("kcenter needs candidate features")
        f = c.features.float().flatten(1)
        n, m, dev = f.shape[0], c.counts.numel(), f.device
        idx = torch.arange(n, device=dev)
        mean = torch.zeros(m, f.shape[1], device=dev).index_add_(0, c.cls, f)
        mean = mean / c.counts.unsqueeze(1).to(f.dtype)
        kept = torch.zeros(n, dtype=torch.bool, device=dev)
        taken = torch.zeros(m, dtype=torch.int64, device=dev)
        # distance to the nearest kept candidate; before the first pick, to the class mean
        # negated (so the first pick is the candidate nearest the mean)
        dist = -(f - mean[c.cls]).norm(dim=1)
        for _ in range(int(c.keep.max()) if m else 0):
            want = (taken < c.keep)[c.cls] & ~kept
            if not bool(want.any()):
                break
            d = torch.where(want, dist, torch.tensor(-float("inf"), device=dev))
            best = torch.full((m,), -float("inf"), device=dev).scatter_reduce(
                0, c.cls, d, reduce="amax")
            hit = want & (d == best[c.cls])
            # one pick per class: the lowest index among the class's farthest candidates
            first = torch.full((m,), n, device=dev).scatter_reduce(
                0, c.cls, torch.where(hit, idx, n), reduce="amin")
            picks = first[first < n]
            kept[picks] = True
            taken[c.cls[picks]] += 1
            new = torch.zeros(n, f.shape[1], device=dev)
            new_of_class = torch.full((m,), -1, dtype=torch.int64, device=dev)
            new_of_class[c.cls[picks]] = picks
            p = new_of_class[c.cls]
            has = p >= 0
            new[has] = f[p[has]]
            gap = (f - new).norm(dim=1)
            fresh = taken[c.cls] == 1
            dist = torch.where(has, torch.where(fresh, gap, torch.minimum(dist, gap)), dist)
        return kept
