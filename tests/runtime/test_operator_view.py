"""Attacks on what the operator sees: a device's retained status, shown by `edgefcl status`,
and the strings the daemon logs about a device, are untrusted."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.runtime.links import topics
from edgefcl.runtime.status import FleetView, render
from edgefcl.support.logs import DEVICE_KEYS, PlainFormatter, Repeats
from edgefcl.transport.codec import Message, encode

FLEET = "ops"
ESC = "\x1b"


def view_with(**fields) -> FleetView:
    cfg = apply(RunConfig(), {"mqtt": {"fleet": FLEET}, "quiet": True})
    view = FleetView(cfg)
    tp = topics(cfg.mqtt)
    good = {"state": "online", "task": 0, "consumed": 5, "version": 2, "rounds": 1,
            "prequential": 50.0, "rejected": 0, "time": 1.0}
    view.on_message(tp.status("dev1"), encode(Message("status", good | fields, sender="dev1"),
                                              fleet=FLEET))
    view.on_message(tp.status("dev2"), encode(Message("status", good, sender="dev2"),
                                              fleet=FLEET))
    return view


@pytest.mark.parametrize("fields", [
    {"state": f"{ESC}[2J{ESC}[Hon\rline", "reason": "x\ndev9      online   1   99.9"},
    {"reason": f"{ESC}]0;pwned\a{ESC}[8mhidden"},
    {"accuracy": "high"}, {"state": {"a": 1}}, {"rejected": [1, 2]},
    {"prequential": b"\x00\x01"}, {"accuracy": np.zeros(2, np.float32)},
    {"accuracy": float("nan"), "prequential": float("inf")},
    {"task": 2**63 - 1, "consumed": -5, "version": "7"},
])
def test_a_devices_status_cannot_crash_or_drive_the_operators_terminal(fields) -> None:
    # the attacks: escapes and newlines in status fields reached the operator's terminal raw
    # (a cleared screen, a forged row for a device that does not exist); a field of the wrong
    # type crashed `edgefcl status` with a traceback; NaN made --json output invalid
    snap = view_with(**fields).snapshot()
    text = render(snap)
    assert ESC not in text and "\r" not in text and "\a" not in text
    assert not any(line.lstrip().startswith("dev9") for line in text.splitlines())
    rows = text.split("\n\n", 1)[1].splitlines()  # the device table
    assert rows[0].startswith("device")
    assert [r.split()[0] for r in rows[1:]] in (["dev1", "dev2"], ["dev1", "dev1:", "dev2"])
    json.loads(json.dumps(snap, allow_nan=False))  # strict JSON, whatever the device sent


def test_a_long_reason_is_cut() -> None:
    text = render(view_with(reason="r" * 100_000).snapshot())
    assert len(text) < 2_000


def test_device_strings_cannot_forge_log_lines() -> None:
    # the attack: a `client` field with a newline and a fake "all clients done" line (and an
    # incarnation with a carriage return) was written to the daemon's log as it came
    record = logging.LogRecord("edgefcl.aggregator", logging.WARNING, __file__, 1,
                               "rejected update: claims client %s on %s", (
                                   f"dev2\n2026-01-01 INFO all clients done{ESC}[2K\r", "t"),
                               None)
    line = PlainFormatter("%(levelname)s %(message)s").format(record)
    assert "\n" not in line and ESC not in line and "\r" not in line
    assert "claims client dev2\\n2026-01-01 INFO all clients done\\x1b[2K\\r on t" in line


def test_a_device_sending_rejected_messages_cannot_flood_the_log() -> None:
    # the attack: a device at its inbox rate (50/s) with messages the daemon rejects wrote a
    # warning line for each; now 20 a template a minute, then one line that counts the rest
    repeats = Repeats(burst=20, window=60.0)

    def record(at: float, level: int = logging.WARNING, client: str = "x") -> logging.LogRecord:
        r = logging.LogRecord("edgefcl.aggregator", level, __file__, 1,
                              "rejected update from %s seq %s: %s", (client, 1, "stale"), None)
        r.created = at
        return r

    shown = [r for r in (record(i / 50) for i in range(6000)) if repeats.filter(r)]
    assert len(shown) == 40  # 20 in each of the two minutes
    assert shown[20].getMessage().endswith("(2980 more like this left out)")
    assert repeats.filter(record(59.0, logging.ERROR))  # errors and information always pass
    assert repeats.filter(record(59.0, logging.INFO))
    other = logging.LogRecord("edgefcl.aggregator", logging.WARNING, __file__, 1,
                              "client %s silent for %.0f s: no longer waited for", ("a", 9.0),
                              None)
    assert repeats.filter(other)  # another template has its own allowance


def test_one_device_cannot_hide_another_devices_warnings() -> None:
    # a reviewer helper's attack: counted by template alone, 20 rejections a minute of one
    # device (under 1 % of its inbox rate) hid an honest device's rejection every minute
    repeats = Repeats(burst=20, window=60.0)

    def record(at: float, client: str) -> logging.LogRecord:
        r = logging.LogRecord("edgefcl.aggregator", logging.WARNING, __file__, 1,
                              "rejected update from %s seq %s: %s", (client, 1, "stale"), None)
        r.created, r.device = at, client
        return r

    hidden = 0
    for minute in range(10):
        for k in range(20):
            repeats.filter(record(60 * minute + k, "mallory"))
        hidden += not repeats.filter(record(60 * minute + 30, "honest"))
    assert hidden == 0
    for k in range(3 * DEVICE_KEYS):  # ids that churn cannot grow the table without bound
        repeats.filter(record(600 + k / 1000, f"id{k}"))
    assert len(repeats._seen) <= DEVICE_KEYS + 1


def test_a_silent_aggregator_is_shown_stale_and_a_lost_broker_is_said() -> None:
    import time as clock

    view = view_with()
    tp = topics(view.cfg.mqtt)

    def aggregator(sent: float) -> None:
        body = {"state": "online", "version": 3, "rounds": 3, "time": sent}
        view.on_message(tp.aggregator_status,
                        encode(Message("status", body, sender="aggregator"), fleet=FLEET))

    aggregator(clock.time() - 60)  # the retained status found at start: a minute old
    text = render(view.snapshot())
    assert "aggregator: stale (said online, silent for 60 s)" in text
    aggregator(clock.time() - 60)  # it speaks again (its clock a minute behind)
    fresh = view.snapshot()
    assert not fresh["aggregator"]["stale"] and "aggregator: online" in render(fresh)
    assert "lost the broker" in render(view.snapshot(connected=False))


def test_a_device_clock_ahead_or_behind_does_not_set_its_age() -> None:
    """A device's age is when it spoke by the operator's clock: its own clock is used only
    for the retained status found at start, and never when it is ahead."""
    import time as clock

    view = view_with(time=clock.time() + 3600)  # dev1's clock an hour ahead
    tp = topics(view.cfg.mqtt)
    devices = view.snapshot()["devices"]
    assert devices["dev1"]["last_seen_s"] < 5
    assert devices["dev2"]["last_seen_s"] > 1e9  # retained, sent at time 1.0
    body = {"state": "online", "task": 0, "consumed": 6, "time": clock.time() - 3600}
    view.on_message(tp.status("dev2"), encode(Message("status", body, sender="dev2"),
                                              fleet=FLEET))  # live, its clock an hour behind
    assert view.snapshot()["devices"]["dev2"]["last_seen_s"] < 5


def test_the_backpressure_factor_and_update_limit_are_shown() -> None:
    view = view_with()
    body = {"state": "online", "version": 3, "rounds": 3, "backpressure": 2.1,
            "backpressure_reason": f"shed{ESC}[2J", "update_limit_per_s": 0.46,
            "devices_over_limit": 212, "waiting_superseded": 7, "busy": 0.83,
            "updates_unpaced": 40}
    view.on_message(topics(view.cfg.mqtt).aggregator_status,
                    encode(Message("status", body, sender="aggregator"), fleet=FLEET))
    text = render(view.snapshot())
    assert "backpressure 2.10 (shed" in text and ESC not in text
    assert "update limit 0.46/s per device, 212 devices over it" in text
    assert "7 waiting updates superseded" in text
    assert "40 updates over their device's pace" in text
    assert "main loop busy 83%" in text
    view.on_message(topics(view.cfg.mqtt).aggregator_status,
                    encode(Message("status", {"state": "online", "backpressure": "x"},
                                   sender="aggregator"), fleet=FLEET))
    assert "backpressure" not in render(view.snapshot())  # a wrong type is not shown
    view.on_message(topics(view.cfg.mqtt).aggregator_status,  # its last will: no counters
                    encode(Message("status", {"state": "offline"}, sender="aggregator"),
                           fleet=FLEET))
    text = render(view.snapshot())
    assert "version -   rounds -" in text and "None" not in text


@pytest.mark.mqtt
def test_status_of_a_fleet_that_is_not_there_names_the_fleets_that_are(mosquitto, capsys):
    from edgefcl.runtime.status import watch
    from edgefcl.transport.mqtt import MqttLink

    link = MqttLink(mosquitto, "agg", clean_start=True).connect()
    for fleet in ("demo", "ops"):
        there = apply(RunConfig(), {"mqtt": {"broker": mosquitto, "fleet": fleet}})
        link.publish(topics(there.mqtt).aggregator_status,
                     encode(Message("status", {"state": "online"}, sender="aggregator"),
                            fleet=fleet), retain=True, wait=True)
    for odd in ("x y", "z" * 100):  # names no fleet can have are not echoed
        link.publish(f"edgefcl/{odd}/aggregator/status", b"junk", retain=True, wait=True)
    link.close()
    typo = apply(RunConfig(), {"mqtt": {"broker": mosquitto, "fleet": "dmeo"}})
    assert watch(typo, once=True, wait=0.5) == 1
    err = capsys.readouterr().err
    assert f"nothing of fleet 'dmeo' on {mosquitto}; fleets there: demo, ops" in err
    assert "x y" not in err and "zzz" not in err


def test_a_long_id_cannot_hide_another_device_behind_it() -> None:
    # the attack: rows were keyed by the id's first 40 characters, so a device whose id
    # shared them with a victim's (ids may have 128) took the victim's row
    view = view_with()
    tp = topics(view.cfg.mqtt)
    base = "sensor-" + "x" * 40
    for cid, state in ((base + "-victim", "online"), (base + "-zattacker", "offline")):
        view.on_message(tp.status(cid), encode(Message("status", {"state": state}, sender=cid),
                                               fleet=FLEET))
    devices = view.snapshot()["devices"]
    assert devices[base + "-victim"]["state"] == "online" and len(devices) == 4


def test_a_sharded_roots_workers_are_shown_with_their_rejections() -> None:
    """An operator's finding: the status showed no worker, and a worker's rejections (every
    update stale, say) appeared nowhere."""
    view = view_with()
    tp = topics(view.cfg.mqtt)
    body = {"state": "online", "role": "worker", "version": 15, "partials": 0, "pending": 0,
            "counters": {"accepted": 0, "rejected_stale": 12}}
    view.on_message(tp.worker_status("w0"), encode(Message("status", body, sender="w0"),
                                                   fleet=FLEET))
    agg = {"state": "online", "role": "root", "version": 0, "rounds": 0, "workers": ["w0"]}
    view.on_message(tp.aggregator_status, encode(Message("status", agg, sender="aggregator"),
                                                 fleet=FLEET))
    snap = view.snapshot()
    assert snap["aggregator"]["role"] == "root"
    assert snap["workers"]["w0"]["rejected"] == {"stale": 12}
    assert "worker w0: online   version 15" in render(snap)
    assert "rejected 12 (stale 12)" in render(snap)
    assert set(snap["devices"]) == {"dev1", "dev2"}  # a worker is no device
