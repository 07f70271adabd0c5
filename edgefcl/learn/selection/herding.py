"""herding: iCaRL's exemplar rule. Within every class, greedily add the candidate that keeps
the mean of the kept (L2-normalised) penultimate features closest to the class mean: a
representative allotment that still covers the class. Needs no uncertainty scores."""

import torch
from torch import Tensor

from edgefcl.learn.selection.base import Candidates, Selection, register


@register
class Herding(Selection):
    name = "herding"
    needs_scores = False
    needs_features = True

    def select(self, c: Candidates) -> Tensor:
        if c.features is None:
            raise ValueError("herding needs candidate features")
        f = torch.nn.functional.normalize(c.features.float().flatten(1), dim=1)
        n, m, dev = f.shape[0], c.counts.numel(), f.device
        idx = torch.arange(n, device=dev)
        mean = torch.zeros(m, f.shape[1], device=dev).index_add_(0, c.cls, f)
        mean = mean / c.counts.unsqueeze(1).to(f.dtype)
        kept = torch.zeros(n, dtype=torch.bool, device=dev)
        taken = torch.zeros(m, dtype=torch.int64, device=dev)
        total = torch.zeros(m, f.shape[1], device=dev)  # sum of the kept features per class
        for _ in range(int(c.keep.max()) if m else 0):
            want = (taken < c.keep)[c.cls] & ~kept
            if not bool(want.any()):
                break
            t = (taken + 1).to(f.dtype)[c.cls].unsqueeze(1)
            cost = (mean[c.cls] - (total[c.cls] + f) / t).norm(dim=1)
            cost = torch.where(want, cost, torch.tensor(float("inf"), device=dev))
            best = torch.full((m,), float("inf"), device=dev).scatter_reduce(
                0, c.cls, cost, reduce="amin")
            hit = want & (cost == best[c.cls])
            first = torch.full((m,), n, device=dev).scatter_reduce(
                0, c.cls, torch.where(hit, idx, n), reduce="amin")
            picks = first[first < n]
            kept[picks] = True
            taken[c.cls[picks]] += 1
            total.index_add_(0, c.cls[picks], f[picks])
        return kept
