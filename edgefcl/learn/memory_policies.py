"""The replay memory's storage policies: one `MemoryPolicy` descriptor each, in `POLICIES`.

A policy is a `ReplayMemory` subclass (`learn/memory.py`: the shared storage; one module per
policy), named here by a reference "module:Class" that `methods.load` loads on first use, so
this module depends on nothing heavy: the CLI and `import edgefcl` load it. A method names its
policy (`learn/methods.py`); `current_share` is what `--current-share auto` gives the policy.
A new policy is its class and one line in `POLICIES`."""

from __future__ import annotations

from dataclasses import dataclass

from edgefcl.config import NAMES, ConfigError


@dataclass(frozen=True)
class MemoryPolicy:
    """How a replay memory chooses what it keeps."""

    name: str
    memory: str
    """Reference of its `ReplayMemory` subclass, "module:Class" (its `name` is this one)."""
    current_share: str
    """The `current_share` that `auto` resolves to for it (`config.CURRENT_SHARES`)."""
    help: str


POLICIES: dict[str, MemoryPolicy] = {p.name: p for p in (
    MemoryPolicy("balanced-score", "edgefcl.learn.memory_scored:BalancedScoreMemory",
                 current_share="stream",
                 help="class-balanced, ranked by an uncertainty score (BI and the other "
                      "scores); the memory study chose the stream share"),
    MemoryPolicy("reservoir", "edgefcl.learn.memory_reservoir:ReservoirMemory",
                 current_share="equal", help="reservoir sampling over the stream (ER)"),
    MemoryPolicy("balanced-random", "edgefcl.learn.memory_balanced:BalancedRandomMemory",
                 current_share="equal",
                 help="class-balanced, a uniform draw within a class (CBR)"),
)}
NAMES["memories"] = POLICIES  # what `config.resolve_current_share` reads


def get_policy(name: str) -> MemoryPolicy:
    """The descriptor of policy `name`; ConfigError listing the policies otherwise."""
    found = POLICIES.get(name)
    if found is None:
        raise ConfigError(f"unknown memory policy '{name}'; choose from {', '.join(POLICIES)}")
    return found
