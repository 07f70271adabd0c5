"""`edgefcl status`: the aggregator and every device of a fleet, read from the retained status
topics (and the retained `config`). What a device published is untrusted: every value shown
is made a number, or a short printable string, when the snapshot is taken (`_int`, `_num`,
`_text`), so that no status can crash the view, make its JSON invalid or drive the
operator's terminal (escapes, carriage returns, newlines that forge rows)."""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import sys
import threading
import time
from typing import Any, TextIO

from edgefcl.config import RunConfig
from edgefcl.runtime.bodies import is_int, is_number
from edgefcl.runtime.links import open_link, topics
from edgefcl.support.logs import one_line
from edgefcl.support.units import fmt_bytes
from edgefcl.transport.codec import CodecError, Message, decode
from edgefcl.transport.mqtt import MqttLink


class FleetView:
    """What the status topics said last, per sender, with the time each arrived."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.topics = topics(cfg.mqtt)
        self.lock = threading.Lock()
        self.config: dict[str, Any] | None = None
        self.aggregator: dict[str, Any] | None = None
        self.devices: dict[str, dict[str, Any]] = {}
        self.workers: dict[str, dict[str, Any]] = {}  # a sharded root's workers and sites
        self._seen: set[str] = set()  # topics a message arrived on

    def on_message(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.cfg.mqtt.fleet)
        except CodecError:
            return
        if not isinstance(msg, Message):
            return
        body = dict(msg.body) | {"received": time.time()}
        with self.lock:
            # a sender's later messages are live: their arrival says when it spoke
            body["live"] = topic in self._seen
            self._seen.add(topic)
            if topic == self.topics.config and msg.kind == "config":
                self.config = body
            elif topic == self.topics.aggregator_status and msg.kind == "status":
                self.aggregator = body
            elif msg.kind == "status":
                try:
                    kind, worker = self.topics.worker_from(topic)
                except ValueError:
                    kind = worker = None
                if kind == "workers":
                    if worker in self.workers or len(self.workers) < MAX_WORKERS:
                        self.workers[worker] = body
                    return
                try:
                    self.devices[self.topics.client_from(topic)] = body
                except ValueError:
                    return

    def snapshot(self, connected: bool = True) -> dict[str, Any]:
        """Everything known now, as plain JSON-able data; `connected`: whether this view's
        own link to the broker is up (when it is not, nothing it shows is fresh)."""
        now = time.time()
        with self.lock:
            agg = _aggregator_row(self.aggregator, now) if self.aggregator else None
            devices = {_text(cid, 128): _device_row(b, now)  # a whole id: 40 characters hid
                       # one device behind another whose id began alike
                       for cid, b in sorted(self.devices.items())}
            workers = {_text(w, 64): _worker_row(b, now) for w, b in sorted(self.workers.items())}
            config = _plain(self.config) if self.config else None
        if config:
            config.pop("received", None)
        return {"fleet": self.cfg.mqtt.fleet, "broker": self.cfg.mqtt.broker,
                "time": round(now, 3), "connected": connected, "config": config,
                "aggregator": agg, "workers": workers, "devices": devices}


def _num(v: Any) -> float | None:
    """A finite real number, or None for anything else."""
    return float(v) if is_number(v) and math.isfinite(v) and abs(v) < 1e18 else None


def _int(v: Any) -> int | None:
    """An integer of at most 18 digits, or None for anything else."""
    return v if is_int(v) and abs(v) < 10**18 else None


def _text(v: Any, size: int) -> str:
    """A string of at most `size` characters, non-printable ones escaped ("?" for a value
    that is not a string)."""
    if not isinstance(v, str):
        return "?"
    v = one_line(v[:size])
    return v if len(v) <= size else v[: size - 3] + "..."


def _plain(v: Any, depth: int = 0) -> Any:
    """`v` as strict JSON data: finite numbers, short strings, lists and maps of them."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return _int(v) if isinstance(v, int) else _num(v)
    if isinstance(v, str):
        return _text(v, 200)
    if isinstance(v, (list, tuple)) and depth < 8:
        return [_plain(x, depth + 1) for x in v[:1024]]
    if isinstance(v, dict) and depth < 8:
        return {_text(str(k), 64): _plain(x, depth + 1) for k, x in list(v.items())[:1024]}
    return "?"


def _age(body: dict[str, Any], now: float) -> float:
    """Seconds since the sender last spoke: since the message arrived when it came live; for
    the retained one the view found at start, since the sender's own time, unless that is later
    than the arrival (a device clock ahead). A device clock behind shows that one too old until
    the device speaks again."""
    sent = _num(body.get("time"))
    at = body["received"]
    if not body.get("live") and sent is not None:
        at = min(sent, at)
    return round(max(0.0, now - at), 1)


STALE_AFTER_S = 10.0
"""An aggregator that says it is online but published nothing for this long (it publishes
every 2 s) is shown as stale: it, or its link to the broker, is gone."""


def _aggregator_row(b: dict[str, Any], now: float) -> dict[str, Any]:
    counters = b.get("counters") if isinstance(b.get("counters"), dict) else {}
    rejected = _rejected(counters)
    last = (b.get("last_rounds") or [None])[-1] if isinstance(b.get("last_rounds"), list) \
        else None
    last_time = _num(last.get("time")) if isinstance(last, dict) else None
    bytes_in = b.get("bytes_in")
    ids = [_text(c, 40) for c in b.get("active", []) if isinstance(b.get("active"), list)]
    done = [_text(c, 40) for c in b.get("done", []) if isinstance(b.get("done"), list)]
    state = _text(b.get("state", "?"), 12)
    seen = _age(b, now)
    flooding = b.get("flooding") if isinstance(b.get("flooding"), dict) else {}
    return {"state": state, "stale": state == "online" and seen > STALE_AFTER_S,
            "role": _text(b.get("role", "single"), 8),
            "flooding": {_text(k, 40): _int(v) or 0 for k, v in list(flooding.items())[:5]},
            "version": _int(b.get("version")),
            "rounds": _int(b.get("rounds")), "active": ids, "done": done,
            "accepted": _int(counters.get("accepted")) or 0, "rejected": rejected,
            "bytes_in": sum(_int(n) or 0 for n in bytes_in.values())
            if isinstance(bytes_in, dict) else _int(bytes_in) or 0,
            "bytes_out": _int(b.get("bytes_out")) or 0,
            "last_round_age_s": round(now - last_time, 1) if last_time is not None else None,
            "accuracy": _num(b.get("accuracy")), "last_seen_s": seen,
            "backpressure": _num(b.get("backpressure")),
            "backpressure_reason": _text(b.get("backpressure_reason", ""), 20),
            "update_limit_per_s": _num(b.get("update_limit_per_s")),
            "devices_over_limit": _int(b.get("devices_over_limit")),
            "waiting_superseded": _int(b.get("waiting_superseded")),
            "updates_unpaced": _int(b.get("updates_unpaced")),
            "busy": _num(b.get("busy"))}


MAX_WORKERS = 64
"""Worker statuses the view keeps (the ACL lets only workers publish them)."""


def _rejected(counters: Any) -> dict[str, int]:
    """The `rejected_<reason>` counters of a status's counters, by reason."""
    if not isinstance(counters, dict):
        return {}
    return {_text(k[len("rejected_"):], 40): _int(v) or 0 for k, v in counters.items()
            if isinstance(k, str) and k.startswith("rejected_")}


def _worker_row(b: dict[str, Any], now: float) -> dict[str, Any]:
    return {"state": _text(b.get("state", "?"), 12), "role": _text(b.get("role", "?"), 8),
            "version": _int(b.get("version")), "partials": _int(b.get("partials")),
            "pending": _int(b.get("pending")), "rejected": _rejected(b.get("counters")),
            "last_seen_s": _age(b, now)}


def _device_row(b: dict[str, Any], now: float) -> dict[str, Any]:
    reason = b.get("reason")
    return {"state": _text(b.get("state", "?"), 12), "task": _int(b.get("task")),
            "batches": _int(b.get("consumed")), "version": _int(b.get("version")),
            "rounds": _int(b.get("rounds")), "prequential": _num(b.get("prequential")),
            "accuracy": _num(b.get("accuracy")), "rejected": _int(b.get("rejected")) or 0,
            "last_seen_s": _age(b, now), "reason": None if reason is None else _text(reason, 300)}


def _fmt(v: Any, spec: str = "", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _said_rejected(rejected: dict[str, int]) -> str:
    """`rejected N (reason n, ...)` of a row's rejections by reason."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()))
    return f"rejected {sum(rejected.values())}" + (f" ({reasons})" if reasons else "")


def render(snap: dict[str, Any]) -> str:
    """The snapshot as a table for a terminal."""
    lines = [f"fleet {snap['fleet']} on {snap['broker']}   "
             f"{time.strftime('%H:%M:%S', time.localtime(snap['time']))}"
             + ("" if snap.get("connected", True)
                else "   (lost the broker: reconnecting; what follows is old)")]
    a = snap["aggregator"]
    if a is None:
        lines.append("aggregator: not seen (no retained status)")
    else:
        state = (f"stale (said online, silent for {a['last_seen_s']:.0f} s)" if a.get("stale")
                 else a["state"])
        lines += [
            f"aggregator{' (root)' if a.get('role') == 'root' else ''}: {state}   "
            f"version {_fmt(a['version'])}   rounds {_fmt(a['rounds'])}   "
            f"active {len(a['active'])}   done {len(a['done'])}   last seen "
            f"{a['last_seen_s']:.0f} s ago",
            f"  updates accepted {a['accepted']}, {_said_rejected(a['rejected'])}"
            f"   bytes in {fmt_bytes(a['bytes_in'])}, out {fmt_bytes(a['bytes_out'])}",
            f"  last round {_fmt(a['last_round_age_s'], '.0f')} s ago   fleet accuracy "
            f"{_fmt(a['accuracy'], '.1f')}{' %' if a['accuracy'] is not None else ''}"
            + ("" if a.get("busy") is None else f"   main loop busy {a['busy']:.0%}"),
        ]
        if a.get("backpressure") is not None:
            limit = a.get("update_limit_per_s")
            lines.append(
                f"  backpressure {a['backpressure']:.2f}"
                + (f" ({a['backpressure_reason']})" if a.get("backpressure_reason") else "")
                + ("" if limit is None else f"   update limit {limit:.2f}/s per device, "
                   f"{_fmt(a.get('devices_over_limit'))} devices over it")
                + ("" if not a.get("waiting_superseded") else
                   f"   {a['waiting_superseded']} waiting updates superseded")
                + ("" if not a.get("updates_unpaced") else
                   f"   {a['updates_unpaced']} updates over their device's pace"))
        if a.get("flooding"):
            lines.append("  flooding (messages shed over their share): " + ", ".join(
                f"{k} {v}" for k, v in a["flooding"].items()))
    for wid, w in snap.get("workers", {}).items():
        lines.append(f"  {w['role']} {wid}: {w['state']}   version {_fmt(w['version'])}   "
                     f"partials {_fmt(w['partials'])}   pending {_fmt(w['pending'])}   "
                     f"{_said_rejected(w['rejected'])}   last seen "
                     f"{w['last_seen_s']:.0f} s ago")
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


def live(view: FleetView, link: MqttLink, out: TextIO, interval: float) -> None:
    """Redraw the table in place until Ctrl-C (rich's Live: no flicker), with this process's
    own log lines (a lost connection, say) printed above the table, never inside it."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def frame() -> Text:
        return Text(render(view.snapshot(link.is_connected)) + "\n(Ctrl-C to quit)")

    console = Console(file=out)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    with Live(frame(), console=console, auto_refresh=False, redirect_stderr=True,
              transient=False) as ui:
        streams = [h.setStream(sys.stderr) for h in handlers]  # rich's proxy: above the table
        try:
            while True:
                time.sleep(interval)
                ui.update(frame(), refresh=True)
        finally:
            for h, stream in zip(handlers, streams, strict=True):
                h.setStream(stream)


SHOWN_FLEET = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Fleet names `fleets_on` shows (topic levels are untrusted text)."""
MAX_SHOWN_FLEETS = 20


def fleets_on(link: MqttLink, root: str, wait: float) -> list[str]:
    """The fleets under topic root `root` whose aggregator left a retained status (those the
    broker lets this user read; at most MAX_SHOWN_FLEETS, plain names only)."""
    level = len(root.split("/"))
    seen: set[str] = set()

    def on(topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if (len(parts) == level + 3 and SHOWN_FLEET.fullmatch(parts[level])
                and len(seen) < MAX_SHOWN_FLEETS):
            seen.add(parts[level])

    link.subscribe(f"{root}/+/aggregator/status", on)
    time.sleep(wait)
    return sorted(seen)


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
        for pattern in (t.config, t.aggregator_status, t.statuses, t.worker_statuses):
            link.subscribe(pattern, view.on_message)
        time.sleep(max(0.0, wait))
        if once or as_json:
            snap = view.snapshot()
            out.write((json.dumps(snap, indent=1) if as_json else render(snap)) + "\n")
            out.flush()
            if snap["aggregator"] is None and not snap["devices"]:
                there = fleets_on(link, cfg.mqtt.topic_root, max(0.0, wait))
                print(f"edgefcl status: nothing of fleet '{cfg.mqtt.fleet}' on "
                      f"{cfg.mqtt.broker}" + (f"; fleets there: {', '.join(there)}" if there
                                              else ""), file=sys.stderr)
                return 1
            return 0
        try:
            if out.isatty():
                live(view, link, out, interval)
            while True:  # not a terminal: one table after another
                out.write(render(view.snapshot(link.is_connected)) + "\n\n")
                out.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
    finally:
        link.close()
