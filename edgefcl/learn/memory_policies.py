"""The replay memory's storage policies: one `MemoryPolicy` descriptor each, in `POLICIES`.

`learn/memory.py` acts on a policy's flags, never on its name: `balanced` (a per-group
allotment by water-filling, `ClassBalanced` by default; otherwise reservoir sampling over the
stream) and `ranked` (an uncertainty score ranks the over-quota groups: the learner scores
candidates and keeps a perturber for it). A method names its policy (`learn/methods.py`);
`current_share` is what `--current-share auto` gives the policy. Depends on nothing heavy:
the CLI and `import edgefcl` load it."""

from __future__ import annotations

from dataclasses import dataclass

from edgefcl.config import NAMES, ConfigError


@dataclass(frozen=True)
class MemoryPolicy:
    """How a replay memory chooses what it keeps."""

    name: str
    balanced: bool
    """Groups (classes) share the capacity by water-filling; False: a reservoir sample."""
    ranked: bool
    """An uncertainty score ranks the samples of over-quota groups (needs a scorer)."""
    current_share: str
    """The `current_share` that `auto` resolves to for it (`config.CURRENT_SHARES`)."""
    help: str


RESERVOIR = MemoryPolicy("reservoir", balanced=False, ranked=False, current_share="equal",
                         help="reservoir sampling over the stream (ER)")
BALANCED_RANDOM = MemoryPolicy("balanced-random", balanced=True, ranked=False,
                               current_share="equal",
                               help="class-balanced, a uniform draw within a class (CBR)")
BALANCED_SCORE = MemoryPolicy("balanced-score", balanced=True, ranked=True,
                              current_share="stream",
                              help="class-balanced, ranked by an uncertainty score (BI and "
                                   "the other scores); the memory study chose the stream share")

POLICIES: dict[str, MemoryPolicy] = {p.name: p for p in (BALANCED_SCORE, RESERVOIR,
                                                          BALANCED_RANDOM)}
NAMES["memories"] = POLICIES  # what `config.resolve_current_share` reads


def get_policy(policy: str | MemoryPolicy) -> MemoryPolicy:
    """The descriptor of `policy` (a name or a descriptor); ConfigError for an unknown name."""
    if isinstance(policy, MemoryPolicy):
        return policy
    found = POLICIES.get(policy)
    if found is None:
        raise ConfigError(f"unknown memory policy '{policy}'; choose from {', '.join(POLICIES)}")
    return found
