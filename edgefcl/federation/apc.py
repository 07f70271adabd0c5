"""Server side of APC / FedWeIT (NOTES.md §2): entry-wise average of the base parameters B over
the clients that sent them, and a bounded knowledge base of task-adaptive parameters.

Update payload (encoding `apc`), per global tensor `w`:
- decomposed layers: `w::rows` / `w::val`, the rows (output units) of B the client sends, with
  absolute values;
- other tensors (biases, BatchNorm): dense `w`;
- once per task, optionally: `w::kb::idx` / `w::kb::val`, the sparse task-adaptive A of the
  task the client just finished.
Global: every spec tensor, plus `w::kb` of shape (kb_size, *w.shape), a ring of the last
kb_size task-adaptive contributions (slot = contribution number % kb_size, so unchanged slots
cost nothing on a delta downlink), and `apc::kb_next`, the next contribution number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgefcl.federation.aggregation import STRATEGIES, Spec, Strategy
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.sparse import KB, EntrySums, SparseError, decode_payload, entries

if TYPE_CHECKING:
    from edgefcl.federation.aggregator import Aggregator

KB_NEXT = "apc::kb_next"


class APCFedAvg(Strategy):
    """APC aggregation: B entry-wise over senders (weighted by samples), dense tensors over all
    senders, both mixed with the previous global; knowledge-base contributions go into the
    ring in the order they are added (client order in lock-step)."""

    encoding = "apc"
    forms = frozenset({"dense", "idx", "rows"})

    def __init__(self, mix_weight: float = 0.5) -> None:
        super().__init__(mix_weight)
        self.acc = EntrySums()
        self.kb_size = 0
        self.spec: Spec = {}
        self.contributions: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []

    def bind(self, agg: Aggregator) -> None:
        """Read the spec and the knowledge-base size from the aggregator."""
        self.spec = dict(agg.spec)
        self.kb_size = agg.fed.apc_kb_size

    def check(self, update: Update, spec: Spec) -> str | None:
        try:
            decode_payload(update.tensors, spec, self.forms, kb=True)
        except SparseError as e:
            return e.reason
        return None

    def add(self, update: Update) -> None:
        payload = decode_payload(update.tensors, self.spec, self.forms, kb=True)
        w = float(max(update.num_samples, 1))
        for name, pos, vals in entries(payload, None):
            self.acc.add(name, int(np.prod(self.spec[name])), pos, vals, w)
        for name, t in payload.dense.items():
            self.acc.add(name, t.size, None, t, w)
        if payload.kb and self.kb_size > 0:
            self.contributions.append(payload.kb)

    def result(self, previous: Tensors) -> Tensors:
        if not self.acc.sums:
            raise ValueError("no contributions to average")
        out = self.acc.result(previous, self.mix_weight)
        if self.contributions:
            out.update(self._knowledge_base(previous))
        return out

    def _knowledge_base(self, previous: Tensors) -> Tensors:
        K = self.kb_size
        names = sorted({n for c in self.contributions for n in c}
                       | {k[: -len(KB)] for k in previous if k.endswith(KB)})
        kb = {n: (np.array(previous[n + KB], np.float32) if n + KB in previous
                  else np.zeros((K, *self.spec[n]), np.float32)) for n in names}
        nxt = int(previous.get(KB_NEXT, 0))
        for contrib in self.contributions:
            slot = nxt % K
            for n in names:
                kb[n][slot] = 0.0
                if n in contrib:
                    pos, vals = contrib[n]
                    kb[n][slot].reshape(-1)[pos] = vals
            nxt += 1
        out: Tensors = {n + KB: kb[n] for n in names}
        out[KB_NEXT] = np.array(nxt, np.int64)
        return out


STRATEGIES[("apc", "fedavg")] = APCFedAvg
