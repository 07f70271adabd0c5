"""Task-free operation and online stream metrics.

Before a client trains on a mini-batch it looks at it once with the current model (one eval
forward pass, no gradient). From that pass:

- Prequential (test-then-train) accuracy: the predictions are counted before the model ever
  trains on the batch.
- Task-free drift detection (`task_free`): a river ADWIN detector watches a per-sample signal
  and a detection where the signal went *up* opens a new segment, which the client then
  uses as its task id (burn-in restarts, replay excludes the segment, the memory ranks the
  segment's classes). Signals: "loss" = the per-sample cross-entropy before training (new
  classes give large losses); "features" = the per-sample distance of the input to its nearest
  neighbour among the last BANK inputs, divided by the bank's own mean nearest-neighbour
  distance (label- and model-free). ADWIN gets the batch's samples one by one: its bound needs
  sample counts, and with per-batch means the sub-windows of short tasks (9 batches on the
  demo) are too small to ever cut.

The true task of each batch is recorded only for the report (`drift_report`), never used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from edgefcl.config import ConfigError, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.learn.models import eval_mode
from edgefcl.learn.views import ClientView, LearnerView

SIGNALS = ("loss", "features")
DEFAULT_DELTA = {"loss": 0.002, "features": 0.05}
"""ADWIN confidence per signal when LearnConfig.drift_delta is 0 (measured on digits/mnist1d:
the feature signal's shifts are smaller, so it needs a less conservative bound)."""
GRACE = 10
"""Samples ADWIN sees after a (re)start before it may detect again."""
REARM = 2 * GRACE
"""After a fall of the signal ADWIN restarts from this many most recent values."""
BANK = 100
"""Recent inputs the "features" signal compares each new input with."""
TOLERANCE = 4
"""Batches after a true boundary within which a detection counts as finding it."""


@torch.no_grad()
def peek_logits(model: torch.nn.Module, x: Tensor) -> Tensor:
    """Logits of x from `model` in eval mode without gradients (modes restored after)."""
    with eval_mode(model):
        return model(x)


class Prequential:
    """Test-then-train accuracy over a stream: samples predicted right before training on
    them, and samples seen. (Two counts; river's `metrics.Accuracy`, used before, loads scipy
    with its metrics package, 1.6-2.4 s at the start of every client process.) The right
    predictions are summed where the model runs and read back only when `correct` is read,
    so counting a batch never waits for the device."""

    def __init__(self) -> None:
        self._correct = 0
        self._pending: Tensor | None = None  # right predictions not yet read back
        self.samples = 0

    def update(self, y_true: Tensor | np.ndarray, y_pred: Tensor | np.ndarray) -> None:
        """Count a batch's predictions against its labels (tensors on any device, or arrays)."""
        right = torch.as_tensor(y_true).eq(torch.as_tensor(y_pred)).sum()
        self._pending = right if self._pending is None else self._pending + right
        self.samples += len(y_true)

    @property
    def correct(self) -> int:
        """Samples predicted right before training on them (reads the device's sum back)."""
        if self._pending is not None:
            self._correct += int(self._pending)
            self._pending = None
        return self._correct

    @property
    def accuracy(self) -> float:
        """Fraction of samples predicted right before training on them (0 before any)."""
        return self.correct / self.samples if self.samples else 0.0

    def __getstate__(self) -> dict:
        """The two counts (a checkpoint holds no device tensor)."""
        return {"correct": self.correct, "samples": self.samples}

    def __setstate__(self, state: dict) -> None:
        """Restore, also from a checkpoint written when the counts were a river metric."""
        metric = state.pop("metric", None)
        if metric is not None:
            state["samples"] = int(metric.cm.total_weight)
            state["correct"] = int(round(float(metric.cm.total_true_positives)))
        self._correct, self.samples, self._pending = state["correct"], state["samples"], None


class DriftDetector:
    """Segments a stream at upward shifts of a per-sample signal (ADWIN, river).

    `observe(batch, x, logits)` returns the segment id of the batch: 0 for the first segment,
    +1 at every detection. `segments` and `true_tasks` hold one entry per batch seen.
    """

    def __init__(self, signal: str = "loss", delta: float = 0.0, grace: int = GRACE,
                 bank: int = BANK) -> None:
        if signal not in SIGNALS:
            raise ConfigError(f"unknown drift_signal '{signal}'; choose from {', '.join(SIGNALS)}")
        self.signal = signal
        self.delta = delta or DEFAULT_DELTA[signal]
        if not 0 < self.delta < 1:
            raise ConfigError(f"drift_delta must be in (0, 1), got {self.delta}")
        self.grace = grace
        self.adwin = self._adwin([])
        self._recent: deque[float] = deque(maxlen=REARM)
        self.bank_size = bank
        self._bank: Tensor | None = None
        self._ref = 1.0
        self.segment = 0
        self.segments: list[int] = []
        self.true_tasks: list[int] = []

    def values(self, x: Tensor, y: Tensor, logits: Tensor | None) -> np.ndarray:
        """The batch's per-sample signal (N,)."""
        if self.signal == "loss":
            if logits is None:
                raise ConfigError("the loss signal needs the batch's logits")
            return F.cross_entropy(logits.float(), y, reduction="none").cpu().numpy()
        f = x.detach().flatten(1).float()
        out = np.zeros(0)
        if self._bank is not None and len(self._bank) >= 2:
            out = (torch.cdist(f, self._bank).amin(1) / self._ref).cpu().numpy()
        bank = f if self._bank is None else torch.cat([self._bank, f])[-self.bank_size:]
        if len(bank) >= 2:
            d = torch.cdist(bank, bank)
            d.fill_diagonal_(float("inf"))
            self._ref = max(float(d.amin(1).mean()), 1e-8)
        self._bank = bank
        return out

    def _adwin(self, window: list[float]) -> Any:
        from river import drift  # river imports in ~1 s: only when a client needs it

        a = drift.ADWIN(delta=self.delta, clock=1, grace_period=self.grace,
                        min_window_length=1)
        for v in window:
            a.update(v)
        return a

    def update(self, values: np.ndarray) -> bool:
        """Feed the values to ADWIN; True when it detected a rise of the signal's mean.

        A detection is a rise when the mean of the newest `grace` values exceeds ADWIN's
        estimate before the detection. A rise starts a new segment and ADWIN starts afresh.
        After a fall (the model learned the segment) ADWIN restarts from the REARM most recent
        values rather than from nothing (river 0.26 forgets its whole window after any
        detection), so a fall just before a task boundary cannot leave it without a reference
        when the boundary comes.
        """
        rise = False
        for v in values.tolist():  # river detectors take one value per call
            before = self.adwin.estimation
            self.adwin.update(v)
            self._recent.append(v)
            if self.adwin.drift_detected:
                # the direction from the newest values: river only cuts the oldest buckets,
                # so its new estimate can fall even when the newest values jumped up
                newest = list(self._recent)[-self.grace:]
                up = sum(newest) / len(newest) > before
                rise = rise or up
                self.adwin = self._adwin([] if up else list(self._recent))
        return rise

    def observe(self, batch: Batch, x: Tensor, y: Tensor, logits: Tensor | None) -> int:
        """The segment id of this batch (a new one when the batch shows a shift)."""
        if self.update(self.values(x, y, logits)) and self.segments:
            self.segment += 1
        self.segments.append(self.segment)
        self.true_tasks.append(int(batch.task))
        return self.segment


class StreamMonitor:
    """What a client computes from a batch before training on it: prequential accuracy and,
    in task-free mode, the detected segment id (returned by `observe`)."""

    def __init__(self, learn: LearnConfig) -> None:
        self.prequential = Prequential() if learn.prequential else None
        self.drift = DriftDetector(learn.drift_signal, learn.drift_delta) if learn.task_free \
            else None

    @property
    def needs_logits(self) -> bool:
        """Whether `observe` looks at the batch's logits (prequential, or the loss signal)."""
        return self.prequential is not None or (self.drift is not None
                                                and self.drift.signal == "loss")

    def observe(self, client: LearnerView, batch: Batch, x: Tensor, y: Tensor,
                logits: Tensor | None = None) -> int:
        """The task id the learner should use for the batch (the true one unless task-free).
        `logits`: the batch's `peek_logits`, when the caller computed them (stacked clients)."""
        t0 = client.clock.now()
        if logits is None and self.needs_logits:
            logits = peek_logits(client.model, x)
        if self.prequential is not None and logits is not None:
            protos = client.protos
            if protos is None:
                self.prequential.update(y, logits.argmax(1))
            else:  # library rows; an empty library or a new label is a miss (-1 != -2)
                pred = (logits.argmax(1) if logits.shape[1]
                        else torch.full((len(batch.y),), -2, device=logits.device))
                self.prequential.update(
                    torch.from_numpy(protos.targets(batch.y)).to(logits.device), pred)
        task = batch.task if self.drift is None else self.drift.observe(batch, x, y, logits)
        client.timings["monitor"] += client.clock.now() - t0
        return task


def make_monitor(learn: LearnConfig) -> StreamMonitor | None:
    """The client's stream monitor, or None when neither prequential nor task_free is on."""
    return StreamMonitor(learn) if learn.prequential or learn.task_free else None


# -- reporting ---------------------------------------------------------------------------------
def boundaries(ids: Sequence[int]) -> list[int]:
    """Batch indices (0-based) where the id differs from the previous batch's."""
    a = np.asarray(ids)
    return (np.flatnonzero(a[1:] != a[:-1]) + 1).tolist() if len(a) > 1 else []


def match_boundaries(true: Sequence[int], detected: Sequence[int],
                     tolerance: int = TOLERANCE) -> list[tuple[int, int]]:
    """(true, detected) pairs: each true boundary b takes the earliest unused detection d with
    b <= d <= b + tolerance and d before the next true boundary."""
    pairs: list[tuple[int, int]] = []
    det = sorted(detected)
    used: set[int] = set()
    ts = sorted(true)
    for i, b in enumerate(ts):
        end = min(b + tolerance, ts[i + 1] - 1) if i + 1 < len(ts) else b + tolerance
        for d in det:
            if b <= d <= end and d not in used:
                used.add(d)
                pairs.append((b, d))
                break
    return pairs


def _scores(n_true: int, n_detected: int, delays: list[int]) -> dict[str, Any]:
    return {"precision": len(delays) / n_detected if n_detected else None,
            "recall": len(delays) / n_true if n_true else None,
            "mean_delay": float(np.mean(delays)) if delays else None}


def drift_report(detectors: dict[str, DriftDetector],
                 tolerance: int = TOLERANCE) -> dict[str, Any]:
    """True vs detected boundaries per client, matched within `tolerance` batches, and
    precision / recall / mean delay (batches) over all clients."""
    per_client: dict[str, Any] = {}
    for cid, d in detectors.items():
        true, det = boundaries(d.true_tasks), boundaries(d.segments)
        pairs = match_boundaries(true, det, tolerance)
        per_client[cid] = {"true": true, "detected": det, "matched": [list(p) for p in pairs],
                           **_scores(len(true), len(det), [b - a for a, b in pairs])}
    signal = next(iter(detectors.values())).signal if detectors else None
    return summarize_drift(per_client, signal, tolerance)


def summarize_drift(per_client: dict[str, Any], signal: str | None,
                    tolerance: int = TOLERANCE) -> dict[str, Any]:
    """Totals over the per-client entries of `drift_report` (also used to merge the reports
    of devices that ran in separate processes)."""
    n_true = sum(len(c["true"]) for c in per_client.values())
    n_det = sum(len(c["detected"]) for c in per_client.values())
    delays = [b - a for c in per_client.values() for a, b in c["matched"]]
    return {"signal": signal, "tolerance": tolerance, "true_boundaries": n_true,
            "detected_boundaries": n_det, "matched": len(delays),
            **_scores(n_true, n_det, delays), "per_client": per_client}


def stream_report(clients: Sequence[ClientView]) -> dict[str, Any]:
    """results.json entries of the clients' monitors: prequential accuracy (%, mean and per
    client) and the drift report (task-free runs)."""
    monitors = {c.cid: c.monitor for c in clients if getattr(c, "monitor", None) is not None}
    out: dict[str, Any] = {}
    preq = {cid: 100.0 * m.prequential.accuracy for cid, m in monitors.items()
            if m.prequential is not None}
    if preq:
        out["prequential_accuracy"] = float(np.mean(list(preq.values())))
        out["prequential_per_client"] = preq
    detectors = {cid: m.drift for cid, m in monitors.items() if m.drift is not None}
    if detectors:
        out["drift"] = drift_report(detectors)
    return out


def stream_lines(extra: dict[str, Any]) -> list[str]:
    """Run-table lines for the entries of `stream_report`."""
    lines = []
    if "prequential_accuracy" in extra:
        lines.append(f"  prequential (test-then-train) accuracy = "
                     f"{extra['prequential_accuracy']:.1f} %")
    d = extra.get("drift")
    if d:
        def f(v: float | None, spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        lines.append(f"  task-free ({d['signal']}): {d['matched']}/{d['true_boundaries']} "
                     f"boundaries found, {d['detected_boundaries']} detections, "
                     f"precision {f(d['precision'], '.2f')} recall {f(d['recall'], '.2f')} "
                     f"mean delay {f(d['mean_delay'], '.1f')} batches (tolerance "
                     f"{d['tolerance']})")
    return lines
