"""Admission: the semantic checks an update or tick passes before it may count in a round.

The codec has already checked the structure; admission checks what a device claims about
itself, so that no single device can outweigh the fleet or lock others out:

- roster: only roster clients take part. The roster is the configured list (`fed.roster`), or
  learned from the first clients seen, capped at `fed.roster_cap` (0: `fed.clients`);
- sequence numbers move forward by at most `fed.max_seq_gap` (also from zero for a client's
  first message), so a huge seq cannot lock a client id out;
- the claimed mini-batch is plausible for the seq (`batch <= burn_in + jump * seq`) and, within
  a task, moves forward (an old update re-sent with a new seq is a replay);
- `base_version` is not ahead of the aggregator's version;
- a device announces an incarnation id (status `online`); a new one (a reinstalled device)
  starts a new session whose sequence numbers may start again at 1;
- `num_samples` is at most `batch * batch_size` (the stream samples a device can have seen in
  its task; `fed.sample_cap` overrides), and class counts are positive and add up to it.

Each check returns a short reason that the aggregator counts as `rejected_<reason>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgefcl.config import FedConfig
from edgefcl.federation.messages import Tick, Update


def parse_roster(text: str) -> frozenset[str]:
    """Client ids of a comma-separated roster ('' -> empty: learned)."""
    return frozenset(c.strip() for c in text.split(",") if c.strip())


@dataclass
class Admission:
    """Roster and per-client progress of one aggregator (saved with its state)."""

    fed: FedConfig
    batch_size: int | None = None
    roster: set[str] = field(default_factory=set)
    last_seq: dict[str, int] = field(default_factory=dict)
    last_batch: dict[str, tuple[int, int]] = field(default_factory=dict)
    """client -> (task, batch) of its last accepted update."""
    incarnation: dict[str, str] = field(default_factory=dict)
    """client -> the incarnation id its device announced (a reinstall draws a new one)."""

    def __post_init__(self) -> None:
        self.fixed = parse_roster(self.fed.roster)
        self.roster |= set(self.fixed)

    @property
    def cap(self) -> int:
        return len(self.fixed) if self.fixed else (self.fed.roster_cap or self.fed.clients)

    def may_join(self, client: str) -> bool:
        """Whether `client` is on the roster or there is room to learn it."""
        return client in self.roster or (not self.fixed and len(self.roster) < self.cap)

    def admit(self, client: str) -> bool:
        """Whether `client` is (now) on the roster; learns it while there is room."""
        if not self.may_join(client):
            return False
        self.roster.add(client)
        return True

    def check(self, msg: Update | Tick, version: int) -> str | None:
        """The reason to reject `msg` (before the encoding-specific checks), or None."""
        last = self.last_seq.get(msg.client, 0)
        if msg.seq <= last:
            return "duplicate"
        if msg.seq - last > self.fed.max_seq_gap:
            return "seq"
        if msg.batch < 0 or msg.batch > self.fed.burn_in + self.fed.jump * msg.seq:
            return "batch"
        if not self.may_join(msg.client):  # learned only once a message is accepted
            return "roster"
        if isinstance(msg, Tick):
            return None
        prev = self.last_batch.get(msg.client)
        if prev is not None and prev[0] == msg.task and msg.batch <= prev[1]:
            return "replay"
        if msg.base_version > version or msg.base_version < 0:
            return "base"
        return self.check_samples(msg)

    def check_samples(self, u: Update) -> str | None:
        """num_samples bounded, class counts positive and adding up to it."""
        if u.num_samples < 1:
            return "samples"
        cap = self.fed.sample_cap or (u.batch * self.batch_size if self.batch_size else 0)
        if cap and u.num_samples > cap:
            return "samples"
        if u.class_counts is not None:
            counts = u.class_counts
            if not counts or min(counts.values()) < 1 or min(counts) < 0:
                return "classes"
            if sum(counts.values()) != u.num_samples:
                return "classes"
        return None

    def session(self, client: str, incarnation: str) -> bool:
        """Record `client`'s incarnation; True when it is a new one of a known client: a
        reinstalled device whose sequence numbers start again (its progress is forgotten).
        A device can only reset its own session (the topic is its identity)."""
        old = self.incarnation.get(client)
        self.incarnation[client] = incarnation
        if old is None or old == incarnation:
            return False
        self.last_seq.pop(client, None)
        self.last_batch.pop(client, None)
        return True

    def accept(self, msg: Update | Tick) -> None:
        """Record an accepted message's progress (and learn its client)."""
        self.admit(msg.client)
        self.last_seq[msg.client] = msg.seq
        if isinstance(msg, Update):
            self.last_batch[msg.client] = (msg.task, msg.batch)

    def state(self) -> dict:
        return {"roster": sorted(self.roster), "last_seq": dict(self.last_seq),
                "last_batch": {k: list(v) for k, v in self.last_batch.items()},
                "incarnation": dict(self.incarnation)}

    def load_state(self, state: dict) -> None:
        self.roster = set(state.get("roster", [])) | set(self.fixed)
        self.last_seq = {str(k): int(v) for k, v in state.get("last_seq", {}).items()}
        self.last_batch = {str(k): (int(v[0]), int(v[1]))
                           for k, v in state.get("last_batch", {}).items()}
        self.incarnation = {str(k): str(v) for k, v in state.get("incarnation", {}).items()}
