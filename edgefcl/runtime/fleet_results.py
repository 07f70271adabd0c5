"""Fleet-level results of the aggregator daemon: held-out accuracy per round (--eval-data),
what devices report when their stream is done, the "all clients done" summary and the
state directory's results.json (read by `edgefcl report` and `edgefcl export`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import RunConfig, public_dict
from edgefcl.federation.label_rows import ROWS_KEY
from edgefcl.federation.messages import GlobalModel
from edgefcl.federation.registry import get_encoding
from edgefcl.outcomes.metrics import forgetting, last_accuracy, pm, sample_std
from edgefcl.support.statefiles import save_json, save_tensors
from edgefcl.support.units import fmt_bytes
from edgefcl.transport.codec import CodecError

log = logging.getLogger("edgefcl.aggregator")

RESULTS_FILE, MODEL_FILE = "results.json", "model.npz"
SELF_REPORTED = "devices (self-reported)"
"""`accuracy_source` of a fleet's A, F and matrix: the devices' own reports, which no one
checked; the aggregator's own measure is `fleet.held_out_accuracy` (with --eval-data)."""
MAX_CLAIMED_BYTES = 1 << 50
"""The largest downlink byte count a device's report may claim (a bound, not a check)."""
WRITE_EVERY_S = 5.0
"""Seconds between two writes of results.json once the run is done (a later report waits)."""


def _matrix(value: Any, tasks: int) -> np.ndarray | None:
    """A device's reported accuracy matrix (fractions), or None unless it is a finite (T, T)
    array in [0, 1]: device reports are untrusted."""
    try:
        m = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        return None
    if m.shape != (tasks, tasks) or not np.isfinite(m).all() or m.min() < 0 or m.max() > 1:
        return None
    return m


class FleetResults:
    """Watches a fleet for the aggregator daemon.

    `profile` is the fleet profile published in `config` (runtime/join.py); `evaluator`
    (global -> accuracy %) runs on every new global when --eval-data is given.
    """

    def __init__(self, cfg: RunConfig, state_dir: Path, profile: dict[str, Any],
                 evaluator: Callable[[GlobalModel], float] | None = None,
                 labels: list[str] | None = None, started: float | None = None) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.profile = profile
        self.evaluator = evaluator
        self.labels = labels
        self.accuracy: float | None = None
        self.last_round_time: float | None = None
        self.reports: dict[str, dict[str, Any]] = {}
        self.summarized = False
        self.last_summary: dict[str, Any] | None = None
        self.written_at = float("-inf")
        self.started = started if started is not None else time.time()

    def on_round(self, g: GlobalModel) -> dict[str, Any]:
        """Extra fields of the round's log line: the held-out accuracy of the new global."""
        self.last_round_time = time.time()
        if self.evaluator is None:
            return {}
        try:
            self.accuracy = self.evaluator(g)
        except (ValueError, RuntimeError, CodecError) as e:  # never stop serving for it
            log.warning("could not evaluate version %d: %s", g.version, e)
            return {}
        log.info("version %d: accuracy on held-out data %.1f %%", g.version, self.accuracy)
        return {"accuracy": self.accuracy}

    def status(self) -> dict[str, Any]:
        """Extra fields of the aggregator's status."""
        return {"time": round(time.time(), 3), "accuracy": self.accuracy,
                "last_round_time": self.last_round_time}

    def on_device_done(self, client: str, body: dict[str, Any]) -> None:
        """A device said its stream is done; keep what it measured (checked, untrusted). Its
        first report of each device process (the status's `incarnation`) counts: one that
        re-sent `done` with a new matrix each time made the daemon rewrite results.json, the
        model and its state per status; a report of a new process replaces an earlier one
        (the previous run's retained `done` reaches a new aggregator first)."""
        inc = body.get("incarnation") if isinstance(body.get("incarnation"), str) else None
        if client in self.reports and self.reports[client]["incarnation"] == inc:
            return
        T = self.cfg.data.tasks
        m = _matrix(body.get("accuracy_matrix"), T)
        down = body.get("bytes_down")
        self.reports[client] = {"accuracy_matrix": m, "incarnation": inc,
                                "batches": body.get("consumed") if
                                isinstance(body.get("consumed"), int) else None,
                                "bytes_down": down if isinstance(down, int) and
                                0 <= down <= MAX_CLAIMED_BYTES else None}
        self.summarized = False

    def check_done(self, done: set[str], active: set[str], daemon, force: bool = False) -> bool:
        """Log the fleet summary and write results.json once every expected client is done
        and none is active, at most every WRITE_EVERY_S unless `force` (the daemon stops:
        then of the clients done so far, if any, with the others named missing); True when
        that happened now."""
        complete = not active and len(done) >= self.cfg.fed.clients
        if self.summarized or not (complete or (force and done)) or (
                not force and time.monotonic() - self.written_at < WRITE_EVERY_S):
            return False  # (a report within WRITE_EVERY_S of the last write waits for it)
        self.summarized = True
        summary = self.summary(done, daemon)
        if not complete:  # a device died or left: the fleet's results without it, said so
            summary["missing"] = sorted(set(daemon.agg.admission.roster) - done)[:100]
            summary["line"] = (f"{len(done)} of {self.cfg.fed.clients} clients done (not "
                               f"done: {', '.join(summary['missing'][:5]) or 'unknown'}); "
                               + summary["line"])
        if summary == self.last_summary:
            return False  # a report that changed nothing (retained statuses after a restart)
        self.last_summary = summary
        log.log(logging.INFO if complete else logging.WARNING, "%s: %s",
                "all clients done" if complete else "stopped before every client was done",
                summary["line"])
        if summary["rounds"] == 0:
            log.warning("the fleet never federated (rounds = 0): every client trained alone")
        self.write(summary, daemon)
        self.written_at = time.monotonic()
        return True

    def summary(self, done: set[str], daemon) -> dict[str, Any]:
        agg = daemon.agg
        counters = dict(agg.counters)
        rejected = {k: v for k, v in counters.items() if k.startswith("rejected_")}
        mats = {c: r["accuracy_matrix"] for c, r in self.reports.items()
                if c in done and r["accuracy_matrix"] is not None}
        out: dict[str, Any] = {"clients": sorted(done), "rounds": agg.rounds,
                               "version": agg.global_.version,
                               "accepted": counters.get("accepted", 0), "rejected": rejected,
                               "held_out_accuracy": self.accuracy}
        parts = [f"{len(done)} clients", f"{agg.rounds} rounds (version {agg.global_.version})"]
        if mats:
            acc = np.stack([mats[c] for c in sorted(mats)])
            per_a = [100 * last_accuracy(a[None]) for a in acc]
            per_f = [100 * forgetting(a[None]) for a in acc]
            out.update(accuracy=float(np.mean(per_a)), forgetting=float(np.mean(per_f)),
                       accuracy_matrix=np.round(100 * acc, 4).tolist(),
                       matrix_clients=sorted(mats))
            parts.append(f"A = {pm(np.mean(per_a), sample_std(per_a))} %, "
                         f"F = {pm(np.mean(per_f), sample_std(per_f))} % "
                         f"(mean ± sample std over {len(mats)} clients, self-reported)")
        parts.append(f"updates accepted {out['accepted']}, rejected {sum(rejected.values())}")
        if self.accuracy is not None:
            parts.append(f"global accuracy on held-out data {self.accuracy:.1f} %")
        out["line"] = "; ".join(parts)
        return out

    def write(self, summary: dict[str, Any], daemon) -> None:
        """results.json in the state directory: the fleet's A, F, accuracy matrix, rounds,
        bytes, config, labels and (dense/sparse) the model to export."""
        agg = daemon.agg
        bytes_in = dict(daemon.bytes_in)
        down = {c: r["bytes_down"] for c, r in sorted(self.reports.items())
                if c in summary.get("clients", ()) and r.get("bytes_down") is not None}
        res: dict[str, Any] = {
            "method": self.cfg.learn.method, "seed": self.cfg.seed, "rounds": agg.rounds,
            "fleet": {k: v for k, v in summary.items() if k != "accuracy_matrix"},
            "bytes_up": sum(bytes_in.values()), "bytes_down": sum(down.values()),
            "bytes_up_per_client": bytes_in, "bytes_down_per_client": down,
            "bytes_published": daemon.bytes_out,
            "aggregator": dict(agg.counters), "config": public_dict(self.cfg),
            "global_sha256": _sha(agg.global_), "wall_s": round(time.time() - self.started, 3),
        }
        if "accuracy_matrix" in summary:  # what devices said they measured: untrusted
            res.update(accuracy=summary["accuracy"], forgetting=summary["forgetting"],
                       accuracy_matrix=summary["accuracy_matrix"],
                       accuracy_source=SELF_REPORTED)
        else:
            res = self._keep_measured(res)
        library = agg.global_.prototypes
        if library is not None:  # head prototypes: class c of the exported model is label c
            res["labels"] = list(library.labels)
        elif self.labels is not None:
            res["labels"] = self.labels
        p = self.profile
        if all(k in p for k in ("model", "sample_shape", "n_classes")) and \
                get_encoding(self.cfg.fed.encoding).exportable:
            res["model_spec"] = {"model": p["model"], "sample_shape": p["sample_shape"],
                                 "n_classes": p["n_classes"], "hidden": self.cfg.learn.hidden}
            tensors = dict(agg.global_.tensors)
            if library is not None:  # the library's rows are the exported classifier
                tensors[ROWS_KEY] = np.asarray(library.rows, np.float32)
            save_tensors(self.state_dir / MODEL_FILE, tensors)
            res["global_file"] = MODEL_FILE
        save_json(self.state_dir / RESULTS_FILE, res)


    def _keep_measured(self, res: dict[str, Any]) -> dict[str, Any]:
        """`res` with the accuracy, forgetting, matrix and downlink of the results.json already
        in the state directory when this process has none of them (a resumed finished run: its
        devices' reports are gone), so that a resume never erases what a run measured."""
        try:
            old = json.loads((self.state_dir / RESULTS_FILE).read_text())
        except (OSError, ValueError):
            return res
        if not isinstance(old, dict) or "accuracy_matrix" not in old:
            return res
        kept = ("accuracy", "forgetting", "accuracy_matrix", "accuracy_source", "bytes_down",
                "bytes_down_per_client")
        log.info("kept the accuracy and downlink of the earlier results.json (the devices' "
                 "reports of this run came before this process)")
        fleet = {**old.get("fleet", {}), **res["fleet"]} if isinstance(old.get("fleet"),
                                                                       dict) else res["fleet"]
        if "missing" not in res["fleet"]:  # (an earlier stop's: this summary has them all)
            fleet.pop("missing", None)
        return res | {k: old[k] for k in kept if k in old} | {"fleet": fleet}


def announce_refusal(cfg: RunConfig, reason: str) -> None:
    """Best effort: a retained aggregator status 'refused' with the reason, so that waiting
    devices and `edgefcl status` say why no aggregator comes online."""
    from edgefcl.runtime.links import open_link, topics
    from edgefcl.transport.codec import Message, encode
    from edgefcl.transport.transport_error import TransportError

    try:
        link = open_link(cfg.mqtt, f"{cfg.mqtt.fleet}-aggregator-refusal", clean_start=True)
    except TransportError:
        return
    try:
        body = {"state": "refused", "reason": reason, "time": round(time.time(), 3)}
        link.publish(topics(cfg.mqtt).aggregator_status,
                     encode(Message("status", body), fleet=cfg.mqtt.fleet, sender="aggregator"),
                     qos=1, retain=True, wait=True)
    finally:
        link.close()


def _sha(g: GlobalModel) -> str:
    from edgefcl.learn.params import global_sha256

    return global_sha256(g.tensors, g.prototypes)


def fleet_table(state_dir: Path, rounds: list[dict[str, Any]]) -> str:
    """What `edgefcl report` prints for an aggregator state directory."""
    lines = [f"aggregator state {state_dir}"]
    res = state_dir / RESULTS_FILE
    if res.is_file():
        saved = json.loads(res.read_text())
        fleet = saved.get("fleet", {})
        if fleet.get("line"):
            lines.append(f"  all clients done: {fleet['line']}")
        if saved.get("accuracy_source"):
            lines.append(f"  A, F and the accuracy per task above: {saved['accuracy_source']}; "
                         "the aggregator's own measure is the held-out accuracy below")
    if rounds:
        accs = [r["accuracy"] for r in rounds if r.get("accuracy") is not None]
        total = sum(r.get("bytes_in", 0) for r in rounds)
        lines.append(f"  rounds {len(rounds)} (last version {rounds[-1].get('version')}), "
                     f"bytes received {fmt_bytes(total)}, "
                     f"{fmt_bytes(total / len(rounds))} per round")
        if accs:
            lines.append(f"  held-out accuracy of the global: first {accs[0]:.1f} %, best "
                         f"{max(accs):.1f} %, last {accs[-1]:.1f} %")
    else:
        lines.append("  no round closed yet")
    return "\n".join(lines)
