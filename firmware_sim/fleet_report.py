"""The report of a firmware_sim fleet run: per device (stream trained exactly once, A, F,
rounds, reconnects, boots, ...), the aggregator's counters, the checks of the fault bar, and
`format_report`, the same as text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.outcomes.metrics import forgetting
from edgefcl.support.statefiles import load_json
from firmware_sim.byzantine import Byzantine
from firmware_sim.faults import CORRUPTION_REASONS, Corruptor, FaultPlan
from firmware_sim.fleet_prepare import FleetLayout, FleetOptions
from firmware_sim.profile import DeviceProfile

ROBUST_COUNTERS = ("clipped", "share_capped", "sigma_floored", "replaced", "new_sessions",
                   "silent_left")


def fleet_report(workdir: Path, layout: FleetLayout, opts: FleetOptions, plan: FaultPlan,
                 profiles: list[DeviceProfile], events: list[dict[str, Any]], wall_s: float,
                 corruptor: Corruptor | None, byzantine: Byzantine | None,
                 aggregator_alive: bool | None) -> dict[str, Any]:
    """The report of the run in `workdir` (the aggregator's state and every device's results)."""
    state = load_json(workdir / "aggregator" / "state.json")
    counters = state.get("counters", {})
    rejected = {k[len("rejected_"):]: v for k, v in counters.items()
                if k.startswith("rejected_")}
    devices: dict[str, Any] = {}
    for cid, exp in layout.expected.items():
        r = json.loads((workdir / "results" / f"{cid}.json").read_text())
        acc = np.asarray(r["accuracy_matrix"], np.float64)
        fw, link, trained = r["firmware"], r["link"], r["trained"]
        devices[cid] = {
            "profile": r["profile"], "batches": r["batches"], "expected": exp.count,
            "exactly_once": (trained["count"] == exp.count
                             and trained["digest"] == exp.digest
                             and trained["out_of_order"] == 0),
            "A": 100 * float(acc[-1].mean()), "F": 100 * forgetting(acc[None]),
            "rounds": r["rounds"], "catch_ups": r.get("catch_ups", 0), "seq": r["seq"],
            "aggregator_last_seq": state.get("last_seq", {}).get(cid, 0),
            "reconnects": link.get("reconnects", 0), "boots": fw.get("boots", 1),
            "inbox_replayed": fw.get("inbox_replayed", 0),
            "redelivered_dropped": fw.get("redelivered_dropped", 0),
            "resent_updates": fw.get("resent_updates", 0),
            "skipped_scoring": fw.get("skipped_scoring", 0),
            "throttle_s": round(fw.get("throttle_s", 0.0), 2),
            "clock_skew_s": round(r.get("clock_skew_s", 0.0), 1),
        }
    corrupt_rejected = sum(rejected.get(k, 0) for k in CORRUPTION_REASONS)
    tap = dict(corruptor.counters) if corruptor is not None else {}
    created = sum(d["seq"] for d in devices.values())
    if byzantine is not None:  # what the attackers sent may be accepted too
        created += sum(byzantine.sent.values())
    accepted = counters.get("accepted", 0)
    checks = {
        "every_stream_finished": all(d["batches"] == d["expected"] for d in devices.values()),
        "no_data_reconsumed": all(d["exactly_once"] for d in devices.values()),
        "no_duplicate_aggregated": accepted <= created and all(
            d["aggregator_last_seq"] <= d["seq"] for d in devices.values()),
        # refused by its checks, or dropped unread: a device's newer update superseded it in
        # the aggregator's inbox (async); never aggregated either way
        "every_corrupted_payload_rejected": (
            tap.get("undetected", 0) == 0
            and corrupt_rejected + counters.get("superseded_in_inbox", 0)
            >= tap.get("injected", 0)),
    }
    return {
        "devices": len(devices), "hosts": len(layout.hosts),
        "per_process": opts.per_process, "profiles": [p.name for p in profiles],
        "seed": opts.seed, "broker": opts.broker, "rate": opts.rate,
        "faults": dataclasses.asdict(plan), "events": events,
        "wall_s": wall_s,
        "rounds": state.get("rounds", 0), "version": state.get("version", 0),
        "updates": {"created": created, "accepted": accepted,
                    "duplicates": rejected.get("duplicate", 0),
                    "stale": rejected.get("stale", 0),
                    "corrupted_rejected": corrupt_rejected,
                    "superseded": counters.get("superseded_in_inbox", 0), "rejected": rejected},
        "corruptor": tap,
        "reconnects": sum(d["reconnects"] for d in devices.values()),
        "A": float(np.mean([d["A"] for d in devices.values()])),
        "F": float(np.mean([d["F"] for d in devices.values()])),
        "checks": checks, "per_device": devices,
        "robust": {k: v for k, v in counters.items()
                   if k in ("clipped", "share_capped", "sigma_floored", "replaced",
                            "new_sessions", "silent_left")},
        "byzantine": {"k": opts.byzantine, "attack": opts.attack,
                      "defences": opts.defences,
                      "sent": dict(byzantine.sent) if byzantine else {},
                      "aggregator_alive_at_end": aggregator_alive},
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as text: totals, checks, then one line per device."""
    u = r["updates"]
    rej = ", ".join(f"{k} {v}" for k, v in sorted(r["updates"]["rejected"].items())) or "none"
    faults = [e for e in r["events"] if e["what"] not in ("started", "finished", "restarted")]
    lines = [
        f"fleet: {r['devices']} devices on {r['hosts']} host processes, profiles "
        f"{', '.join(r['profiles'])}, broker {r['broker']}, seed {r['seed']}, "
        f"{r['wall_s']:.0f} s",
        "faults: " + ("; ".join(f"{e['what']} at {e['t']:.0f} s" for e in faults) or "none"),
        f"rounds {r['rounds']} (global version {r['version']}); updates: created {u['created']}, "
        f"accepted {u['accepted']}, duplicates dropped {u['duplicates']}, stale {u['stale']}, "
        f"corrupted rejected {u['corrupted_rejected']}",
        f"rejections by reason: {rej}",
    ]
    if r["corruptor"]:
        c = r["corruptor"]
        lines.append(f"damaged copies injected {c.get('injected', 0)} (flipped "
                     f"{c.get('mode_flip', 0)}, truncated {c.get('mode_truncate', 0)}), "
                     f"undetected by the codec {c.get('undetected', 0)}")
    b = r.get("byzantine", {})
    if b.get("k"):
        robust = ", ".join(f"{k} {v}" for k, v in sorted(r.get("robust", {}).items())) or "none"
        lines.append(f"byzantine: {b['k']} x {b['attack']}, defences "
                     f"{'on' if b['defences'] else 'off'}, sent {sum(b['sent'].values())}; "
                     f"robust rules applied: {robust}; aggregator alive at the end "
                     f"{'yes' if b['aggregator_alive_at_end'] else 'NO'}")
    lines.append(f"reconnects {r['reconnects']};  A = {r['A']:.1f} %   F = {r['F']:.1f} %")
    lines.append("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                        for k, v in r["checks"].items()))
    head = (f"{'device':7} {'profile':14} {'batches':>7} {'once':>4} {'A %':>6} {'F %':>6} "
            f"{'rounds':>6} {'catch':>5} {'seq':>4} {'reconn':>6} {'boots':>5} {'inbox':>5} "
            f"{'resent':>6} {'skip':>4} {'skew s':>8}")
    lines += ["", head]
    for cid, d in r["per_device"].items():
        lines.append(
            f"{cid:7} {d['profile'][:14]:14} {d['batches']:>3}/{d['expected']:<3} "
            f"{'yes' if d['exactly_once'] else 'NO':>4} {d['A']:6.1f} {d['F']:6.1f} "
            f"{d['rounds']:6d} {d['catch_ups']:5d} {d['seq']:4d} {d['reconnects']:6d} "
            f"{d['boots']:5d} {d['inbox_replayed']:5d} {d['resent_updates']:6d} "
            f"{d['skipped_scoring']:4d} {d['clock_skew_s']:8.1f}")
    return "\n".join(lines)
