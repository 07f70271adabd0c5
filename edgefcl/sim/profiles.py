"""Timing profiles: each device's compute time per mini-batch, its network delays and jitter,
its dropouts and reconnects, all drawn from the seed.

- homogeneous: every device computes a mini-batch in 70 ms (+-10 % jitter; what a demo
  client takes over MQTT on a 2-core machine), 5 ms delays.
- heterogeneous: device speeds spread 10x (log-uniform, 30-300 ms per mini-batch, +-25 %
  jitter), lognormal delays (median 30 ms, sigma 0.8), and 3 % of mini-batches end with a
  dropout of 2 s on average (exponential) after which the device reconnects.
- congested: devices train a mini-batch in 20 ms (+-50 %), and answers are slow: lognormal
  delays, median 0.3 s, sigma 1 (a replayed stream on a busy machine, or a slow link): a
  global comes back 15-30 mini-batches after the update it answers, longer than a tiny task.
- trace:PATH: a JSON file, {"devices": [{...}, ...]}, one object per device in client order
  (the last one repeats for more clients), with the fields of `DeviceTiming`; any field left
  out keeps the homogeneous value. An async `edgefcl simulate --transport mqtt` run keeps the
  trace that matches it in its results.json (`timing_trace`), and `trace:DIR/results.json`
  reads it from there.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from edgefcl.config import PROFILE_KINDS, ConfigError
from edgefcl.support.errors import UserError


class ProfileError(ConfigError, UserError):
    """A timing profile that cannot be used (unknown name, malformed trace, impossible value)."""


@dataclass(frozen=True)
class DeviceTiming:
    """One device's timing: seconds, probabilities per mini-batch."""

    compute_s: float = 0.07
    """Mean time to train one mini-batch."""
    compute_jitter: float = 0.1
    """Each mini-batch takes compute_s * U(1 - jitter, 1 + jitter)."""
    delay_s: float = 0.005
    """Median one-way network delay (device <-> aggregator, through the broker)."""
    delay_sigma: float = 0.0
    """Lognormal sigma of the delay (0: always delay_s)."""
    dropout: float = 0.0
    """Chance that the device drops off after a mini-batch."""
    offline_s: float = 1.0
    """Mean time offline after a dropout (exponential)."""
    start_s: float = 0.0
    """When the device starts its stream (devices of a real fleet start apart)."""

    def check(self, where: str) -> None:
        """ProfileError naming the first impossible value."""
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ProfileError(f"{where}: {f.name} must be a finite number, not {v!r}")
        if self.compute_s <= 0:
            raise ProfileError(f"{where}: compute_s must be > 0 (seconds per mini-batch)")
        if not 0 <= self.compute_jitter < 1:
            raise ProfileError(f"{where}: compute_jitter must be in [0, 1)")
        if min(self.delay_s, self.delay_sigma, self.offline_s, self.start_s) < 0:
            raise ProfileError(f"{where}: delay_s, delay_sigma, offline_s and start_s must be "
                               ">= 0")
        if not 0 <= self.dropout < 1:
            raise ProfileError(f"{where}: dropout must be in [0, 1)")


class DeviceClock:
    """One device's draws: every time comes from its own generator (seed, device index)."""

    def __init__(self, timing: DeviceTiming, seed: int, index: int) -> None:
        self.timing = timing
        self.rng = np.random.default_rng([seed, 0xA5C, index])
        self.last = {"up": 0.0, "down": 0.0}
        """When the last message on each link arrives: MQTT keeps a link's order."""

    def compute(self) -> float:
        t = self.timing
        return t.compute_s * self.rng.uniform(1 - t.compute_jitter, 1 + t.compute_jitter)

    def delay(self) -> float:
        """One message's network delay."""
        t = self.timing
        if t.delay_sigma == 0:
            return t.delay_s
        return t.delay_s * float(np.exp(t.delay_sigma * self.rng.standard_normal()))

    def arrival(self, now: float, link: str) -> float:
        """When a message sent on `link` (up, down) at `now` arrives: after its delay, and
        never before the one sent ahead of it on the same link (TCP keeps the order)."""
        self.last[link] = max(now + self.delay(), self.last[link])
        return self.last[link]

    def drops(self) -> float | None:
        """Seconds offline if the device drops off now, else None."""
        t = self.timing
        if t.dropout and self.rng.random() < t.dropout:
            return float(self.rng.exponential(t.offline_s))
        return None


PROFILES = (*PROFILE_KINDS, "trace:PATH")
HETEROGENEOUS_SPREAD = 10.0
"""The heterogeneous profile's ratio of the slowest device's time per mini-batch to the
fastest's."""


def slowdowns(n: int, seed: int, spread: float) -> np.ndarray:
    """Each of `n` devices' slowdown against the fastest, log-uniform in [1, spread], with
    both ends taken by some device (n >= 2): the heterogeneous profile's speeds, which
    `firmware_sim` fleets use too (`--speed-spread`)."""
    rng = np.random.default_rng([seed, 0x5EED])
    out = np.exp(rng.uniform(0.0, np.log(spread), n))
    if n >= 2:
        out[rng.permutation(n)[:2]] = [1.0, spread]
    return out


def timings(spec: str, n: int, seed: int) -> list[DeviceTiming]:
    """The timing of each of `n` devices under profile `spec` (drawn from `seed`)."""
    if spec == "homogeneous":
        return [DeviceTiming()] * n
    if spec == "heterogeneous":
        return [DeviceTiming(compute_s=0.03 * float(f), compute_jitter=0.25, delay_s=0.03,
                             delay_sigma=0.8, dropout=0.03, offline_s=2.0)
                for f in slowdowns(n, seed, HETEROGENEOUS_SPREAD)]
    if spec == "congested":
        return [DeviceTiming(compute_s=0.02, compute_jitter=0.5, delay_s=0.3, delay_sigma=1.0)] * n
    if spec.startswith("trace:"):
        return read_trace(Path(spec[len("trace:"):]), n)
    raise ProfileError(f"unknown timing profile '{spec}'; choose from {', '.join(PROFILES)}")


def read_trace(path: Path, n: int) -> list[DeviceTiming]:
    """Per-device timings from a trace file (module docstring)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"timing trace not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: not a JSON timing trace ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("timing_trace"), dict):
        doc = doc["timing_trace"]  # an MQTT run's results.json: its matched trace
    devices = doc.get("devices") if isinstance(doc, dict) else None
    if not isinstance(devices, list) or not devices:
        raise ProfileError(f'{path}: a timing trace is {{"devices": [{{"compute_s": ...}}, '
                           f'...]}}, one object per device')
    known = {f.name for f in fields(DeviceTiming)}
    out = []
    for i, d in enumerate(devices):
        if not isinstance(d, dict) or set(d) - known:
            extra = sorted(set(d) - known) if isinstance(d, dict) else d
            raise ProfileError(f"{path}: device {i}: unknown fields {extra}; known: "
                               f"{', '.join(sorted(known))}")
        t = DeviceTiming(**d)
        t.check(f"{path}: device {i}")
        out.append(t)
    return [out[min(k, len(out) - 1)] for k in range(n)]


def write_trace(path: Path, devices: list[DeviceTiming]) -> None:
    """Write a trace file that `timings("trace:PATH", ...)` reads back."""
    path.write_text(json.dumps({"devices": [asdict(d) for d in devices]}, indent=1) + "\n")


def matched_trace(device_results: list[dict], closed_at: dict[str, float] | None = None,
                  default_delay_s: float = 0.005) -> dict:
    """The trace that matches an MQTT run: each device's compute time per mini-batch from its
    measured stream time (`stream_s` / batches) and its spread (`batch_s_std`: the uniform
    jitter of that std, at most 0.95), when it started its stream after the first device did
    (`first_batch_at`), its delay, no dropouts; `results.json` carries it as
    `timing_trace` and `trace:results.json` reads it back. The delay of each device is the
    median time from a round's close (`closed_at`, version -> the aggregator's wall time) to
    the global's arrival at the device (`global_arrivals`), `default_delay_s` without them:
    it holds the aggregator's saving and encoding and the broker's transit."""
    devices = []
    starts = [float(r.get("first_batch_at", 0.0)) for r in device_results]
    first = min(starts, default=0.0)
    for r, start in zip(device_results, starts, strict=True):
        batches = max(int(r.get("batches", 0)), 1)
        compute = float(r.get("stream_s", 0.0)) / batches
        compute = max(compute, 1e-4)
        jitter = min(float(r.get("batch_s_std", 0.0)) * math.sqrt(3) / compute, 0.95)
        waits = [t - closed_at[v] for v, t in r.get("global_arrivals", {}).items()
                 if v in (closed_at or {}) and t >= closed_at[v]]
        delay = round(float(np.median(waits)), 4) if waits else default_delay_s
        devices.append(asdict(DeviceTiming(compute_s=round(compute, 6),
                                           compute_jitter=round(jitter, 4), delay_s=delay,
                                           start_s=round(start - first, 3))))
    return {"devices": devices}
