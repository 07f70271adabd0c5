"""Transport-free messages exchanged between clients and the aggregator.

The learning cores produce and consume these plain objects; the transport layer turns them into
msgpack payloads and back (`edgefcl.transport.codec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgefcl.federation.label_rows import LabelRows

Tensors = dict[str, np.ndarray]
"""Named parameter tensors, float32 numpy arrays in a fixed (state_dict) order."""


@dataclass
class Update:
    """One client's contribution to a communication round.

    `tensors` holds the encoded payload: for encoding "dense" the full float32 parameters,
    keyed by parameter name. `base_version` is the global version the client last merged;
    `seq` increases by one per message the client sends (used to drop QoS 1 redeliveries).
    """

    client: str
    base_version: int
    seq: int
    task: int
    batch: int
    num_samples: int
    tensors: Tensors
    encoding: str = "dense"
    class_counts: dict[int, int] | None = None
    prototypes: LabelRows | None = None
    """Rows of the labels this client trained on (head `prototypes`, library shared)."""
    checked: Checked | None = field(default=None, compare=False, repr=False)
    """What the aggregator's validation decoded from `tensors` (server side, never sent)."""

    @property
    def key(self) -> tuple[str, int]:
        """Identity used for de-duplication."""
        return (self.client, self.seq)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors as held in memory, with what validating them decoded (what a
        round's memory bound counts)."""
        held = sum(np.asarray(t).nbytes for t in self.tensors.values())
        return held + (self.checked.nbytes if self.checked is not None else 0)


@dataclass(frozen=True)
class Checked:
    """A payload as the aggregator's validation decoded it, kept on its update so that the
    rule that folds it need not decode it again. It belongs to the very `tensors` and `spec`
    it was decoded from: an update copied with other tensors (a clipped one) or a rule with
    another spec decodes afresh (`for_`)."""

    tensors: Tensors
    spec: dict[str, tuple[int, ...]]
    value: object
    nbytes: int
    """Bytes it holds beyond the tensors."""

    def for_(self, tensors: Tensors, spec: dict[str, tuple[int, ...]]) -> object | None:
        """The decoded value if it was decoded from `tensors` against `spec`, else None."""
        return self.value if tensors is self.tensors and spec == self.spec else None


@dataclass
class Tick:
    """A lock-step report from a client that is not eligible at this mini-batch."""

    client: str
    seq: int
    task: int
    batch: int


@dataclass
class GlobalModel:
    """A global model version published by the aggregator."""

    version: int
    tensors: Tensors
    participants: tuple[str, ...] = field(default_factory=tuple)
    prototypes: LabelRows | None = None
    """The global prototype library (head `prototypes`, library shared)."""
    counted: dict[str, int] = field(default_factory=dict)
    """Async: the sequence number of each participant's update this global holds (counted or
    carried by the task gate's round); a device merges it by what it holds of it
    (`learn/merges.py`). Empty from an aggregator that does not say."""
    run: str | None = None
    """The run the daemon that published it serves (a shard worker follows it: a new run's
    versions start again at 0); None in process."""
