"""Pre-made update payloads that cost almost nothing per message.

An `UpdateTemplate` packs the tensors of one update once. Each message only changes the
client, base version, sequence number and mini-batch counter: they are packed after the
tensors (a msgpack map has no key order), and the SHA-256 digest that seals every payload
(`edgefcl.transport.integrity`) is resumed from the state after the constant prefix instead of
hashing the tensors again. The result is byte for byte a payload the codec accepts
(`codec.decode(..., require_digest=True)`), and one the aggregator's admission accepts from an
honest device: update number `seq` claims the `seq`-th eligible mini-batch of the burn-in/jump
schedule, so every update is new progress.
"""

from __future__ import annotations

import msgpack
import numpy as np

from edgefcl.federation.messages import Update
from edgefcl.federation.schedule import nth_eligible
from edgefcl.transport import integrity
from edgefcl.transport.codec import to_map

_VARYING = ("sender", "client", "base_version", "seq", "batch")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class UpdateTemplate:
    """Update payloads of fixed tensors for any (client, base_version, seq)."""

    def __init__(self, tensors: dict[str, np.ndarray], encoding: str, fleet: str, *,
                 task: int = 0, burn_in: int = 4, jump: int = 2, num_samples: int = 10) -> None:
        whole = to_map(Update("c", 0, 1, task, 1, num_samples, tensors, encoding), fleet=fleet)
        fixed = {k: v for k, v in whole.items() if k not in _VARYING}  # the codec's layout
        self.burn_in, self.jump = burn_in, jump
        n_keys = len(fixed) + len(_VARYING) + 1  # + the digest
        assert n_keys < 16, "a msgpack fixmap holds at most 15 keys"
        self.prefix = bytes([0x80 | n_keys]) + b"".join(_pack(k) + _pack(v)
                                                         for k, v in fixed.items())
        self._hash = integrity.digester(self.prefix)
        self._trailer = _pack(integrity.DIGEST_KEY) + bytes([0xC4, integrity.DIGEST_BYTES])

    def payload(self, client: str, base_version: int, seq: int) -> bytes:
        """The sealed payload of this update from `client`."""
        values = (client, client, base_version, seq, nth_eligible(seq, self.burn_in, self.jump))
        tail = b"".join(_pack(k) + _pack(v) for k, v in zip(_VARYING, values, strict=True))
        tail += self._trailer
        h = self._hash.copy()
        h.update(tail)
        return b"".join((self.prefix, tail, h.digest()[:integrity.DIGEST_BYTES]))

    def __len__(self) -> int:
        return len(self.payload("c0000", 0, 0))
