"""Device profiles: the hardware and link a simulated device runs within, read from TOML.

A profile file has a top-level `name` and the tables [memory], [compute], [link], [flash] and
[reboot] (every key optional; see the dataclasses for meanings and defaults):

    name = "mcu-radio"
    [memory]
    budget_kb = 512            # model + gradients + optimizer + scoring snapshot + replay memory
    [compute]
    slowdown = 3.0             # the device CPU is 3x slower than this host (throttling)
    batch_budget_ms = 60       # compute budget per mini-batch, in device time
    skip_scoring_over_budget = true
    [link]
    latency_ms = 40
    bandwidth_kbps = 250
    duty_period_s = 10         # radio on 8 s of every 10 s
    duty_on_s = 8
    disconnects_per_min = 1    # random link drops, each lasting about disconnect_s
    disconnect_s = 2
    [flash]
    fsync = true
    [reboot]
    mean_uptime_s = 0          # random reboots (crashes) every ~N s of uptime; 0: none
    boot_s = 1

`memory_footprint` / `check_memory_budget` implement the memory budget: a device refuses a
configuration whose model and replay memory do not fit, with a message saying what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefcl.config import ConfigError, read_toml
from edgefcl.learn.methods import get_method
from edgefcl.support.tomlfields import apply_table

if TYPE_CHECKING:
    from edgefcl.learn.client import Client


class ProfileError(ConfigError):
    """A device profile that cannot be used, or a configuration that does not fit it."""


@dataclass
class MemoryProfile:
    """RAM available to the learner."""

    budget_kb: float = 0.0
    """KiB for model, gradients, optimizer state, scoring snapshot and replay memory (0: no
    limit)."""


@dataclass
class ComputeProfile:
    """CPU speed and the per-mini-batch compute budget."""

    slowdown: float = 1.0
    """The device CPU is this many times slower than the host: after each mini-batch the device
    sleeps (slowdown - 1) x the measured compute time (>= 1)."""
    batch_budget_ms: float = 0.0
    """Compute budget per mini-batch in device time (measured host time x slowdown); 0: none."""
    skip_scoring_over_budget: bool = True
    """When the predicted time of a mini-batch exceeds the budget, skip the TTA scoring of that
    batch: the memory falls back to class-balanced random selection for it."""


@dataclass
class LinkProfile:
    """The radio link between the device and the broker."""

    latency_ms: float = 0.0
    """One-way latency added to every byte in each direction."""
    bandwidth_kbps: float = 0.0
    """Bandwidth cap in kilobits per second, each direction (0: no cap)."""
    duty_period_s: float = 0.0
    """Duty cycle period (0: the radio is always on)."""
    duty_on_s: float = 0.0
    """Seconds of each period the radio is on."""
    disconnects_per_min: float = 0.0
    """Rate of random link drops (a Poisson process)."""
    disconnect_s: float = 2.0
    """Mean length of a random link drop (exponentially distributed)."""


@dataclass
class FlashProfile:
    """Non-volatile storage of the device state."""

    fsync: bool = True
    """fsync every state write (survives power loss); false survives process kills only."""


@dataclass
class RebootProfile:
    """Spontaneous reboots: a crash at an arbitrary point, then a boot from flash."""

    mean_uptime_s: float = 0.0
    """Mean uptime between random reboots (exponentially distributed); 0: no reboots."""
    boot_s: float = 1.0
    """Seconds a reboot keeps the device (and its link) down."""


@dataclass
class DeviceProfile:
    """One device type: memory, compute, link, flash and reboot behaviour."""

    name: str = "default"
    memory: MemoryProfile = field(default_factory=MemoryProfile)
    compute: ComputeProfile = field(default_factory=ComputeProfile)
    link: LinkProfile = field(default_factory=LinkProfile)
    flash: FlashProfile = field(default_factory=FlashProfile)
    reboot: RebootProfile = field(default_factory=RebootProfile)


SECTIONS: dict[str, type] = {"memory": MemoryProfile, "compute": ComputeProfile,
                             "link": LinkProfile, "flash": FlashProfile, "reboot": RebootProfile}


def profile_from_dict(values: dict[str, Any], where: str = "profile") -> DeviceProfile:
    """A validated DeviceProfile from a TOML-shaped dict; raises ProfileError."""
    p = DeviceProfile()
    for key, value in values.items():
        if key == "name":
            if not isinstance(value, str) or not value:
                raise ProfileError(f"{where}: name must be a non-empty string")
            p.name = value
        elif key in SECTIONS:
            apply_table(getattr(p, key), key, value, ProfileError, prefix=f"{where}: ")
        else:
            raise ProfileError(f"{where}: unknown key or table '{key}'; known: name, "
                               + ", ".join(f"[{s}]" for s in SECTIONS))
    validate(p, where)
    return p


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a profile TOML file; the profile's name defaults to the file's stem."""
    path = Path(path)
    values = read_toml(path, "device profile", ProfileError)
    values.setdefault("name", path.stem)
    return profile_from_dict(values, str(path))


def validate(p: DeviceProfile, where: str = "profile") -> None:
    """Reject values that cannot work, saying what to fix."""
    m, c, ln, r = p.memory, p.compute, p.link, p.reboot
    checks = [
        (m.budget_kb >= 0, "[memory] budget_kb must be >= 0 (0: no limit)"),
        (c.slowdown >= 1, "[compute] slowdown must be >= 1 (the device is never faster than "
         "the host it is simulated on)"),
        (c.batch_budget_ms >= 0, "[compute] batch_budget_ms must be >= 0 (0: no budget)"),
        (ln.latency_ms >= 0, "[link] latency_ms must be >= 0"),
        (ln.bandwidth_kbps >= 0, "[link] bandwidth_kbps must be >= 0 (0: no cap)"),
        (ln.duty_period_s >= 0, "[link] duty_period_s must be >= 0 (0: always on)"),
        (ln.duty_period_s == 0 or 0 < ln.duty_on_s <= ln.duty_period_s,
         "[link] duty_on_s must be in (0, duty_period_s]"),
        (ln.disconnects_per_min >= 0, "[link] disconnects_per_min must be >= 0"),
        (ln.disconnect_s > 0, "[link] disconnect_s must be > 0"),
        (r.mean_uptime_s >= 0, "[reboot] mean_uptime_s must be >= 0 (0: no reboots)"),
        (r.boot_s >= 0, "[reboot] boot_s must be >= 0"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ProfileError(f"{where}: {msg}")


# -- memory budget ---------------------------------------------------------------------------
SLOT_BYTES = 8 + 8 + 4 + 8
"""Per replay slot besides the sample: label (int64), task (int64), score (float32) and score
version (int64), as ReplayMemory stores them."""


def memory_footprint(client: Client, sample_shape: tuple[int, ...]) -> dict[str, int]:
    """Bytes the learner keeps in RAM, by part (activations and the framework excluded).

    model: parameters and buffers; gradients: one per trainable parameter; optimizer: Adam's
    two moments (SGD without momentum keeps none); scoring: the snapshot of the model used for
    TTA scoring (uncertainty-ranked memories only); replay: capacity x (sample + slot fields).
    """
    params = sum(p.numel() * p.element_size() for p in client.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in client.model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in client.model.parameters()
                    if p.requires_grad)
    scored = client.perturber is not None
    replay = 0
    if client.learn.memory_size > 0 and get_method(client.method).memory is not None:
        replay = client.learn.memory_size * (math.prod(sample_shape) * 4 + SLOT_BYTES)
    return {
        "model": params + buffers,
        "gradients": trainable,
        "optimizer": 2 * trainable if client.learn.optimizer == "adam" else 0,
        "scoring": params + buffers if scored else 0,
        "replay": replay,
    }


def check_memory_budget(profile: DeviceProfile, client: Client,
                        sample_shape: tuple[int, ...]) -> dict[str, int]:
    """The footprint, or ProfileError when it exceeds the profile's memory budget."""
    parts = memory_footprint(client, sample_shape)
    budget = profile.memory.budget_kb * 1024
    total = sum(parts.values())
    if budget and total > budget:
        detail = ", ".join(f"{k} {v / 1024:.1f}" for k, v in parts.items() if v)
        raise ProfileError(
            f"device {client.cid} (profile '{profile.name}'): the learner needs "
            f"{total / 1024:.1f} KiB ({detail}) but [memory] budget_kb is "
            f"{profile.memory.budget_kb:g}; lower [learn] memory_size or hidden, use "
            "optimizer sgd, or raise budget_kb")
    return parts
