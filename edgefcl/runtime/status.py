"""`edgefcl status`: the aggregator and every device of a fleet, read from the retained status
topics (and the retained `config`)."""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from typing import Any

from edgefcl.config import RunConfig
from edgefcl.runtime.links import open_link, topics
from edgefcl.transport.codec import CodecError, Message, decode


class FleetView:
    """What the status topics said last, per sender, with the time each arrived."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.topics = topics(cfg.mqtt)
        self.lock = threading.Lock()
        self.config: dict[str, Any] | None = None
        self.aggregator: dict[str, Any] | None = None
        self.devices: dict[str, dict[str, Any]] = {}

    def on_message(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.cfg.mqtt.fleet)
        except CodecError:
            return
        if not isinstance(msg, Message):
            return
        body = dict(msg.body) | {"received": time.time()}
        with self.lock:
            if topic == self.topics.config and msg.kind == "config":
                self.config = body
            elif topic == self.topics.aggregator_status and msg.kind == "status":
                self.aggregator = body
            elif msg.kind == "status":
                try:
                    self.devices[self.topics.client_from(topic)] = body
                except ValueError:
                    return

    def snapshot(self) -> dict[str, Any]:
        """Everything known now, as plain JSON-able data."""
        now = time.time()
        with self.lock:
            agg = _aggregator_row(self.aggregator, now) if self.aggregator else None
            devices = {cid: _device_row(b, now) for cid, b in sorted(self.devices.items())}
            config = dict(self.config) if self.config else None
        if config:
            config.pop("received", None)
        return {"fleet": self.cfg.mqtt.fleet, "broker": self.cfg.mqtt.broker,
                "time": round(now, 3), "config": config, "aggregator": agg, "devices": devices}


def _age(body: dict[str, Any], now: float) -> float:
    """Seconds since the sender last spoke (its own clock when it sent one, else arrival)."""
    sent = body.get("time")
    t = sent if isinstance(sent, (int, float)) else body["received"]
    return round(max(0.0, now - t), 1)


def _aggregator_row(b: dict[str, Any], now: float) -> dict[str, Any]:
    counters = b.get("counters") or {}
    rejected = {k[len("rejected_"):]: v for k, v in counters.items() if k.startswith("rejected_")}
    last = (b.get("last_rounds") or [None])[-1]
    bytes_in = b.get("bytes_in") or {}
    return {"state": b.get("state", "?"), "version": b.get("version"),
            "rounds": b.get("rounds"), "active": b.get("active", []), "done": b.get("done", []),
            "accepted": counters.get("accepted", 0), "rejected": rejected,
            "bytes_in": sum(bytes_in.values()) if isinstance(bytes_in, dict) else bytes_in,
            "bytes_out": b.get("bytes_out", 0),
            "last_round_age_s": round(now - last["time"], 1) if last and "time" in last
            else None,
            "accuracy": b.get("accuracy"), "last_seen_s": _age(b, now)}


def _device_row(b: dict[str, Any], now: float) -> dict[str, Any]:
    return {"state": b.get("state", "?"), "task": b.get("task"), "batches": b.get("consumed"),
            "version": b.get("version"), "rounds": b.get("rounds"),
            "prequential": b.get("prequential"), "accuracy": b.get("accuracy"),
            "rejected": b.get("rejected", 0), "last_seen_s": _age(b, now),
            "reason": b.get("reason")}


def _fmt(v: Any, spec: str = "", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render(snap: dict[str, Any]) -> str:
    """The snapshot as a table for a terminal."""
    lines = [f"fleet {snap['fleet']} on {snap['broker']}   "
             f"{time.strftime('%H:%M:%S', time.localtime(snap['time']))}"]
    a = snap["aggregator"]
    if a is None:
        lines.append("aggregator: not seen (no retained status)")
    else:
        rej = sum(a["rejected"].values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(a["rejected"].items()))
        lines += [
            f"aggregator: {a['state']}   version {a['version']}   rounds {a['rounds']}   "
            f"active {len(a['active'])}   done {len(a['done'])}   last seen "
            f"{a['last_seen_s']:.0f} s ago",
            f"  updates accepted {a['accepted']}, rejected {rej}"
            + (f" ({reasons})" if reasons else "")
            + f"   bytes in {_mb(a['bytes_in'])}, out {_mb(a['bytes_out'])}",
            f"  last round {_fmt(a['last_round_age_s'], '.0f')} s ago   fleet accuracy "
            f"{_fmt(a['accuracy'], '.1f')}{' %' if a['accuracy'] is not None else ''}",
        ]
    devices = snap["devices"]
    lines.append("")
    if not devices:
        lines.append("no device seen")
    else:
        lines.append(f"{'device':<12} {'state':<9} {'task':>4} {'batches':>7} {'version':>7} "
                     f"{'rounds':>6} {'last seen':>9} {'preq acc':>8} {'A':>6} {'rejected':>8}")
        for cid, d in devices.items():
            task = d["task"] + 1 if isinstance(d["task"], int) and d["task"] >= 0 else None
            lines.append(
                f"{cid:<12} {d['state']:<9} {_fmt(task):>4} {_fmt(d['batches']):>7} "
                f"{_fmt(d['version']):>7} {_fmt(d['rounds']):>6} "
                f"{d['last_seen_s']:>7.0f} s {_fmt(d['prequential'], '.1f'):>8} "
                f"{_fmt(d['accuracy'], '.1f'):>6} {d['rejected']:>8}")
            if d.get("reason"):
                lines.append(f"  {cid}: {d['reason']}")
    return "\n".join(lines)


def watch(cfg: RunConfig, once: bool = False, as_json: bool = False, wait: float = 1.5,
          interval: float = 2.0, out=None) -> int:
    """Print the fleet's status: one snapshot (`once`, `as_json`, or output not a terminal
    with once), else a table refreshed every `interval` s until Ctrl-C. Returns 1 when
    neither the aggregator nor any device of the fleet was seen."""
    out = out or sys.stdout
    view = FleetView(cfg)
    t = view.topics
    link = open_link(cfg.mqtt, f"{cfg.mqtt.fleet}-status-{secrets.token_hex(3)}",
                     clean_start=True)
    try:
        for pattern in (t.config, t.aggregator_status, t.statuses):
            link.subscribe(pattern, view.on_message)
        time.sleep(max(0.0, wait))
        if once or as_json:
            snap = view.snapshot()
            out.write((json.dumps(snap, indent=1) if as_json else render(snap)) + "\n")
            out.flush()
            if snap["aggregator"] is None and not snap["devices"]:
                print(f"edgefcl status: nothing of fleet '{cfg.mqtt.fleet}' on "
                      f"{cfg.mqtt.broker}", file=sys.stderr)
                return 1
            return 0
        live = out.isatty()
        try:
            while True:
                text = render(view.snapshot())
                if live:  # home + clear screen, then the table
                    out.write("\x1b[H\x1b[2J" + text + "\n(Ctrl-C to quit)\n")
                else:
                    out.write(text + "\n\n")
                out.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
    finally:
        link.close()
