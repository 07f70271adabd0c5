"""Server side of APC / FedWeIT (docs/algorithms.md §2): entry-wise average of the base
parameters B over the clients that sent them, and a bounded knowledge base of task-adaptive
parameters.

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

from typing import Protocol

import numpy as np

from edgefcl.config import ConfigError
from edgefcl.federation.encodings import Encoding
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.sparse import KB, EntrySums, decode_payload, entries, payload_reason
from edgefcl.federation.strategy import Spec, Strategy, sample_weight

KB_NEXT = "apc::kb_next"


class APCFedAvg(Strategy):
    """APC aggregation: B entry-wise over senders (weighted by samples), dense tensors over all
    senders, both mixed with the previous global; knowledge-base contributions go into the
    ring in the order they are added (client order in lock-step)."""

    forms = frozenset({"dense", "idx", "rows"})

    def reset(self) -> None:
        self.acc = EntrySums()
        self.contributions: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []

    def add(self, update: Update) -> None:
        payload = decode_payload(update.tensors, self.spec, self.forms, kb=True)
        w = sample_weight(update)
        for name, pos, vals in entries(payload, None):
            self.acc.add(name, int(np.prod(self.spec[name])), pos, vals, w)
        for name, t in payload.dense.items():
            self.acc.add(name, t.size, None, t, w)
        if payload.kb and self.fed.apc_kb_size > 0:
            self.contributions.append(payload.kb)

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray],
                                                   dict[str, np.ndarray]]:
        return self.acc.means()

    def result(self, previous: Tensors) -> Tensors:
        """The mixed base and dense tensors, plus the knowledge-base ring (not mixed)."""
        out = super().result(previous)
        if self.contributions:
            out.update(self._knowledge_base(previous))
        return out

    def _knowledge_base(self, previous: Tensors) -> Tensors:
        K = self.fed.apc_kb_size
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


def check_apc(tensors: Tensors, spec: Spec) -> str | None:
    """Reason to reject an apc payload (rows of B, dense tensors, optional `::kb` pairs)."""
    return payload_reason(tensors, spec, APCFedAvg.forms, kb=True)


# -- client side -------------------------------------------------------------------------------
class PayloadSource(Protocol):
    """What the APC client hooks (`edgefcl.learn.apc_layers.APC`) give the encoder."""

    local_keys: frozenset[str]

    def payload(self, current: Tensors) -> Tensors: ...


class APCEncoder:
    """Client encoder of the `apc` encoding; the APC hooks bind it to the decomposed model
    (they know which rows and task-adaptive parameters to send)."""

    name = "apc"

    def __init__(self) -> None:
        self.hooks: PayloadSource | None = None
        self._sent: Tensors | None = None

    def bind(self, hooks: PayloadSource) -> None:
        self.hooks = hooks

    def encode(self, current: Tensors, base: Tensors) -> Tensors:
        if self.hooks is None:
            raise ConfigError("encoding apc needs method apc (--method apc)")
        self._sent = current
        return self.hooks.payload(current)

    def decode_global(self, tensors: Tensors, current: Tensors) -> Tensors:
        """Shared tensors from the global; local ones (m, A, alpha) as they were when the
        update was sent, so both the replace and the delta merge of the client keep them."""
        local = self.hooks.local_keys if self.hooks is not None else frozenset()
        ref = self._sent if self._sent is not None else current
        return {k: (ref.get(k, current[k]) if k in local else tensors[k]) for k in current}


APC = Encoding(
    name="apc",
    help="FedWeIT decomposition: rows of the base B, sparse task-adaptive parameters "
    "(implied by method apc)",
    make_encoder=lambda fed: APCEncoder(),
    validate=check_apc,
    rules={"fedavg": APCFedAvg},
    form="entries",
    downlink="sparse",
    method="apc",
    knowledge_base=True,
    value_dtypes=("auto", "float32", "float16"),
)
