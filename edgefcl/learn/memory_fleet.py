"""Several class-balanced memories' choices of what they keep, made as one computation.

In a tick of fleet-batched training (`learn/batched.py`) every client's full memory plans its
update alone (the allotment on the host, its scores), then leaves the choice of the candidates
it keeps to `choose_together` (`ReplayMemory.update(defer=True)`). Their candidates are
stacked (each memory's classes numbered after the previous memory's), the uniform draw cuts
every memory's unranked classes in one selection, each rule ranks the classes of every memory
that uses it in one more, and the kept masks come back to the host in one read, with the check
of the memories' new scores for NaN and Inf: a selection and two reads per memory before. A
rule that draws takes each memory's draws from that memory's generator, in the order it draws
alone (`Candidates.segments`): every memory keeps what it keeps alone, bit for bit
(`tests/learn/test_memory_fleet.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from edgefcl.data.types import DataError
from edgefcl.learn.memory import NONFINITE, UNIFORM, Replacement, on_host
from edgefcl.learn.selection import Candidates, Selection


def stack(cands: Sequence[Candidates]) -> Candidates:
    """The candidates of several memories as one set: classes numbered on, each memory's
    draws from its own generator."""
    offsets = np.cumsum([0] + [c.counts.numel() for c in cands[:-1]]).tolist()
    features = (None if any(c.features is None for c in cands)
                else torch.cat([c.features for c in cands]))  # type: ignore[misc]
    return Candidates(torch.cat([c.cls + k for c, k in zip(cands, offsets, strict=True)]),
                      torch.cat([c.counts for c in cands]), torch.cat([c.keep for c in cands]),
                      torch.cat([c.score for c in cands]), features, cands[0].generator,
                      tuple((c.generator, c.cls.numel()) for c in cands))


def choose_together(replacements: Sequence[Replacement]) -> None:
    """Make each replacement's choice (as `Replacement.choose` makes it alone), all at once:
    one uniform selection, one selection per rule, one host read."""
    if len(replacements) < 2 or len({r.uniform.cls.device for r in replacements}) > 1:
        for r in replacements:
            r.choose()
        return
    keep = UNIFORM.select(stack([r.uniform for r in replacements]))
    sizes = [r.uniform.cls.numel() for r in replacements]
    starts = np.cumsum([0, *sizes]).tolist()
    by_rule: dict[Selection, list[int]] = {}  # memories of one spec share its rule
    for i, r in enumerate(replacements):
        if r.ranked is not None:
            by_rule.setdefault(r.ranked[0], []).append(i)
    for rule, members in by_rule.items():
        ranked = [replacements[i].ranked for i in members]
        chosen = rule.select(stack([c for _, c, _ in ranked]))  # type: ignore[misc]
        decided = torch.cat([d for _, _, d in ranked])  # type: ignore[misc]
        at = torch.cat([torch.arange(starts[i], starts[i + 1], device=keep.device)
                        for i in members])
        keep[at] = torch.where(decided, chosen, keep[at])
    unchecked = [r.unchecked for r in replacements if r.unchecked is not None]
    bad = (~torch.isfinite(torch.cat([u.to(keep.device) for u in unchecked])).all()
           if unchecked  # read with the masks
           else torch.zeros((), dtype=torch.bool, device=keep.device))
    flags = on_host(torch.cat([keep, bad.view(1)]))
    if flags[-1]:
        raise DataError(NONFINITE)
    for r, a, b in zip(replacements, starts[:-1], starts[1:], strict=True):
        r.write(flags[a:b])
