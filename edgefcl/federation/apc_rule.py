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

from edgefcl.config import ConfigError, FedConfig
from edgefcl.federation.encodings import Encoding
from edgefcl.federation.messages import Tensors, Update
from edgefcl.federation.share_cap import default_cap
from edgefcl.federation.sparse import KB, EntrySums, decode_payload, entries, payload_reason
from edgefcl.federation.strategy import Spec, Strategy, sample_weight

KB_NEXT = "apc::kb_next"


class APCFedAvg(Strategy):
    """APC aggregation: B entry-wise over senders (weighted by samples), dense tensors over all
    senders, both mixed with the previous global; knowledge-base contributions go into the
    ring in the order they are added (client order in lock-step).

    A contribution is a device's claim, so three rules bound what one device can do to the
    ring (with `clip_factor` 0 and `max_share` 1 it is the plain ring):
    - one contribution per device and task: one for a task it already contributed to, or an
      earlier one, is left out (`kb_repeated`);
    - each of its tensors is clipped to `clip_factor` x the norm of the global's base tensor
      it adapts (`kb_clipped`): honest task-adaptive parameters are sparse and small beside
      the base, an attacker's were written at the value bound, 1e6;
    - a device holds at most its share of the ring's slots (`max_share`; 0: twice an equal
      share of `clients`, at most half): once it holds that many, its contribution replaces
      the one of its own slots the ring would overwrite first (`kb_own_slot`)."""

    forms = frozenset({"dense", "idx", "rows"})

    def __init__(self, fed: FedConfig, spec: Spec) -> None:
        self.owners: list[str] = [""] * fed.apc_kb_size
        """The device whose contribution each ring slot holds ("": none)."""
        self.kb_task: dict[str, int] = {}
        """The task of each device's newest contribution."""
        super().__init__(fed, spec)

    def reset(self) -> None:
        self.acc = EntrySums()
        self.contributions: list[tuple[str, int, dict[str, tuple[np.ndarray, np.ndarray]]]] = []

    def add(self, update: Update) -> None:
        payload = decode_payload(update.tensors, self.spec, self.forms, kb=True)
        w = sample_weight(update)
        for name, pos, vals in entries(payload, None):
            self.acc.add(name, int(np.prod(self.spec[name])), pos, vals, w)
        for name, t in payload.dense.items():
            self.acc.add(name, t.size, None, t, w)
        if payload.kb and self.fed.apc_kb_size > 0:
            self.contributions.append((update.client, int(update.task), payload.kb))

    def estimate(self, previous: Tensors) -> tuple[dict[str, np.ndarray],
                                                   dict[str, np.ndarray]]:
        return self.acc.means()

    def result(self, previous: Tensors) -> Tensors:
        """The mixed base and dense tensors, plus the knowledge-base ring (not mixed)."""
        out = super().result(previous)
        if self.contributions:
            out.update(self._knowledge_base(previous))
        return out

    def kept(self) -> dict:
        return {"kb_owners": list(self.owners), "kb_task": dict(self.kb_task)}

    def load_kept(self, kept: dict) -> None:
        owners = kept.get("kb_owners")
        K = self.fed.apc_kb_size
        ok = isinstance(owners, list) and len(owners) == K and all(
            isinstance(o, str) for o in owners)
        self.owners = list(owners) if ok else [""] * K
        tasks = kept.get("kb_task")
        self.kb_task = {str(c): t for c, t in tasks.items()
                        if isinstance(t, int) and not isinstance(t, bool)} \
            if isinstance(tasks, dict) else {}

    def _slot_quota(self) -> int:
        """The most ring slots one device may hold: its share of them, and never so few
        that the fleet's devices could not fill the ring together."""
        K, share = self.fed.apc_kb_size, self.fed.max_share
        if share >= 1:
            return K
        capped = int(K * (share if share > 0 else default_cap(self.fed.clients)))
        return max(1, capped, -(-K // max(self.fed.clients, 1)))

    def _clipped(self, contrib: dict[str, tuple[np.ndarray, np.ndarray]], previous: Tensors
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """`contrib` with each tensor's norm at most clip_factor x its base tensor's."""
        if self.fed.clip_factor <= 0:
            return contrib
        out = {}
        for n, (pos, vals) in contrib.items():
            norm = float(np.linalg.norm(vals.astype(np.float64)))
            bound = self.fed.clip_factor * float(
                np.linalg.norm(np.asarray(previous[n], np.float64)))
            if norm > bound:
                self.counts["kb_clipped"] += 1
                vals = (vals * (bound / norm)).astype(np.float32)
            out[n] = (pos, vals)
        return out

    def _slot(self, client: str, nxt: int) -> tuple[int, int]:
        """The ring slot `client`'s contribution goes to, and the next contribution number:
        the next slot, or, once it holds its quota, the one of its own that the ring would
        overwrite first."""
        K = self.fed.apc_kb_size
        mine = [(i - nxt) % K for i, o in enumerate(self.owners) if o == client]
        if len(mine) >= self._slot_quota():
            self.counts["kb_own_slot"] += 1
            return (nxt + min(mine)) % K, nxt
        return nxt % K, nxt + 1

    def _knowledge_base(self, previous: Tensors) -> Tensors:
        K = self.fed.apc_kb_size
        names = sorted({n for _, _, c in self.contributions for n in c}
                       | {k[: -len(KB)] for k in previous if k.endswith(KB)})
        kb = {n: (np.array(previous[n + KB], np.float32) if n + KB in previous
                  else np.zeros((K, *self.spec[n]), np.float32)) for n in names}
        nxt = int(previous.get(KB_NEXT, 0))
        for client, task, contrib in self.contributions:
            if task <= self.kb_task.get(client, -1):
                self.counts["kb_repeated"] += 1
                continue
            self.kb_task[client] = task
            contrib = self._clipped(contrib, previous)
            slot, nxt = self._slot(client, nxt)
            self.owners[slot] = client
            for n in names:
                kb[n][slot] = 0.0
                if n in contrib:
                    pos, vals = contrib[n]
                    kb[n][slot].reshape(-1)[pos] = vals
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
