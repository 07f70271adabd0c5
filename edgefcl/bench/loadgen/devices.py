"""A process of lightweight devices: each device is one paho-mqtt client (one connection)
publishing a pre-made update at a fixed rate with QoS 1; all of the process's clients share one
selector loop (paho's external-loop API: loop_read / loop_write / loop_misc), so a process
serves hundreds of devices without a thread each.

A device keeps at most one update in flight and one waiting (paho's queue); an update due
while both are taken is skipped and counted, as a real device keeps only its freshest update.
One more connection per process follows the retained global to learn the current version,
which the devices put in their updates as their base (so they are not stale), and the retained
config for the aggregator's backpressure factor: like a real device (runtime/backpressure.py)
each device then sends one of every `factor` updates due every `1 / rate` s and holds the rest
(counted `held`), with the devices' own `Pacer`, whose credit starts at a level drawn from
the device's id, so the fleet's sends stay spread over time as the factor changes
(stretching every device's period instead would keep the phases of the old period, and the
fleet would send in bursts). The rate is a shared value the bench may change between phases
(`rate`, updates/s per device).

Pacing: with the shared `pacing_index` (into PACINGS; the bench may change it between
phases) `synchronised`, every device's first update falls due at the same instant, as streams
replayed in step or a fleet powered on at once, and only the devices' own send delay
(`Pacer.delay`, once the aggregator advertises `spread_sends`) spreads them; `bursty` is
synchronised with updates due only in the first 10 s of every 40 s (`pacing.in_burst`, as
in `bench backpressure`); `random` starts each device at a random phase of its period. A
fraction `ignoring` of the devices (`ignores`) never consult their pacer: they send every due
update whatever the factor, as a device that does not follow the protocol.

Downlink (`globals`): with `every` each device subscribes to the global and its deltas as
DeviceRunner does; with `pull` it subscribes after each update it sends and leaves once a global
lists it (DeviceRunner under `--downlink pull`); the bytes received are counted.
"""

from __future__ import annotations

import contextlib
import logging
import random
import resource
import selectors
import time
from dataclasses import dataclass

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from edgefcl.bench.loadgen.pacing import PACINGS, in_burst
from edgefcl.bench.loadgen.template import UpdateTemplate
from edgefcl.runtime.backpressure import Pacer, advertised, spread_advertised

log = logging.getLogger("edgefcl.bench.loadgen")

GOLDEN = 0.6180339887498949
"""(sqrt 5 - 1) / 2: i x GOLDEN mod 1 spreads any run of device numbers evenly (`ignores`)."""

COUNTERS = ("connected", "published", "acked", "skipped", "lagged", "held", "dropped",
            "factor_pct", "downlink_bytes")
"""Shared per-process counters; `factor_pct` is the backpressure factor x 100 the process
follows now (a level, not a count); `downlink_bytes` the payload bytes of the globals the
devices received (`globals`)."""


@dataclass
class DeviceSpec:
    """What one device process runs."""

    host: str
    port: int
    fleet: str
    topic_root: str
    first: int
    count: int
    rate: float
    encoding: str
    tensors: dict
    seed: int = 0
    burn_in: int = 4
    jump: int = 2
    max_backpressure: float = 8.0
    ignoring: float = 0.0
    globals: str = "none"
    """`every`: each device subscribes to the global (QoS 0, retained) and its deltas (QoS
    1), as DeviceRunner does; `pull`: each device subscribes to the global after each update
    it sends and unsubscribes once a global lists it; both count the bytes received."""
    deltas: bool = False
    """The fleet's downlink is deltas (`--downlink sparse`, or sparse globals): `every`
    subscribes to the deltas only, as DeviceRunner does (its fetch of the whole global after
    a missed delta is not modelled: QoS 1 misses none while connected)."""


def ignores(i: int, fraction: float) -> bool:
    """Whether device number `i` ignores the backpressure factor: a `fraction` of the fleet,
    spread evenly over the device numbers (a golden-ratio sequence), so that every device
    process holds its share of them."""
    return (i * GOLDEN) % 1.0 < fraction


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most 1M); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def device_id(i: int) -> str:
    return f"d{i:05d}"


class _Device:
    __slots__ = ("cid", "client", "topic", "seq", "due", "send_at", "pacer", "events",
                 "connected", "ignoring", "pulling")

    def __init__(self, cid: str, client: mqtt.Client, topic: str, seed: int = 0,
                 ignoring: bool = False) -> None:
        self.cid, self.client, self.topic = cid, client, topic
        self.seq, self.due, self.events, self.connected = 0, 0.0, 0, False
        self.send_at: float | None = None  # a taken update waiting for its send delay
        self.pacer = Pacer(cid, seed)  # the device's own pacing code, as DeviceRunner's
        self.ignoring = ignoring
        self.pulling = False  # subscribed to the global until one lists it


def _new_client(cid: str, host: str, port: int) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv311,
                    clean_session=True)
    c.max_inflight_messages_set(1)
    c.max_queued_messages_set(2)
    c.connect(host, port, keepalive=60)
    return c


def run_devices(spec: DeviceSpec, counters, go, stop, rate=None, pacing_index=None) -> None:
    """Process main: connect `spec.count` devices, publish while `go` is set, until `stop`.

    `counters` maps the names in COUNTERS to shared integers (multiprocessing.Value); `rate`, a
    shared float, overrides `spec.rate` when given (read every turn of the loop);
    `pacing_index`, a shared index into PACINGS read whenever `go` is set (default: random;
    see the module's docstring).
    """
    raise_fd_limit()
    template = UpdateTemplate(spec.tensors, spec.encoding, spec.fleet, burn_in=spec.burn_in,
                              jump=spec.jump)
    base = f"{spec.topic_root}/{spec.fleet}"
    sel = selectors.DefaultSelector()
    version = [0]
    factor = [1.0]
    spread = [False]
    counters["factor_pct"].value = 100

    def on_message(client, userdata, msg) -> None:
        with contextlib.suppress(Exception):  # a message we cannot read changes nothing
            body = msgpack.unpackb(msg.payload, raw=False)
            if msg.topic.endswith("/config") and body.get("kind") == "config":
                factor[0] = advertised(body, spec.max_backpressure)
                spread[0] = spread_advertised(body)
                counters["factor_pct"].value = round(100 * factor[0])
                return
            v = body.get("version")
            if isinstance(v, int):  # the newest global (a new aggregator may start over at 0)
                version[0] = v

    watcher = _new_client(f"{spec.fleet}-watch{spec.first}", spec.host, spec.port)
    watcher.on_message = on_message
    watcher.on_connect = lambda c, *a: c.subscribe([(f"{base}/global", 0),
                                                    (f"{base}/config", 0)])
    devices: list[_Device] = []

    def on_connect(client, userdata, flags, reason, properties) -> None:
        userdata.connected = not reason.is_failure
        if userdata.connected:
            with counters["connected"].get_lock():
                counters["connected"].value += 1

    received = [0]  # downlink payload bytes not yet added to the shared counter
    downlink = [(f"{base}/global", 0), (f"{base}/global/delta", 1)]

    def on_device_connect(client, userdata, flags, reason, properties) -> None:
        on_connect(client, userdata, flags, reason, properties)
        if userdata.connected and spec.globals == "every":
            client.subscribe(downlink[1:] if spec.deltas else downlink)

    def on_global(client, userdata, msg) -> None:
        received[0] += len(msg.payload)
        if userdata.pulling:  # listening until a global counts its update (DeviceRunner's)
            with contextlib.suppress(Exception):
                parts = msgpack.unpackb(msg.payload, raw=False).get("participants") or ()
                if userdata.cid in parts:
                    userdata.pulling = False
                    client.unsubscribe(downlink[0][0])

    def on_publish(client, userdata, mid, reason, properties) -> None:
        with counters["acked"].get_lock():
            counters["acked"].value += 1

    for i in range(spec.first, spec.first + spec.count):
        cid = device_id(i)
        c = _new_client(cid, spec.host, spec.port)
        d = _Device(cid, c, f"{base}/update/{cid}", spec.seed, ignores(i, spec.ignoring))
        c.user_data_set(d)
        c.on_connect, c.on_publish = on_connect, on_publish
        if spec.globals != "none":
            c.on_connect, c.on_message = on_device_connect, on_global
        devices.append(d)
    watch = _Device("watch", watcher, "")
    for d in [watch, *devices]:
        d.events = selectors.EVENT_READ
        sel.register(d.client.socket(), d.events, d)

    rng = random.Random(spec.seed + spec.first)
    was_going, pacing, start = False, "random", 0.0
    next_misc = 0.0
    while not stop.is_set():
        now = time.monotonic()
        going = go.is_set()
        period = 1.0 / (rate.value if rate is not None else spec.rate)
        if going and not was_going:  # each device's first update falls due
            pacing = PACINGS[pacing_index.value] if pacing_index is not None else "random"
            start, phase = now, period if pacing == "random" else 0.0
            for d in devices:
                d.due = now + rng.random() * phase
                d.send_at = None
        was_going = going
        timeout = 0.05
        if going:
            published = lagged = skipped = held = 0
            for d in devices:
                if not d.connected:
                    continue
                if d.send_at is not None and d.send_at <= now:  # its send delay is over
                    d.send_at = None
                    info = d.client.publish(d.topic, template.payload(d.cid, version[0], d.seq),
                                            qos=1)
                    if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                        published += 1
                        if spec.globals == "pull" and not d.pulling:
                            d.pulling = True
                            d.client.subscribe(downlink[0][0], 0)
                    else:
                        skipped += 1
                if d.due > now:
                    timeout = min(timeout, d.due - now,
                                  d.send_at - now if d.send_at is not None else timeout)
                    continue
                d.seq += 1  # a held update consumes its seq, as on a real device
                d.pacer.factor = 1.0 if d.ignoring else factor[0]
                d.pacer.spreading = spread[0] and not d.ignoring
                if not d.pacer.take():
                    held += 1
                else:  # a new update replaces one still waiting for its delay
                    skipped += d.send_at is not None
                    d.send_at = now + d.pacer.delay(period)
                    timeout = 0.0
                d.due += period
                if pacing == "bursty":
                    d.due = in_burst(d.due, period, start)
                if d.due < now - period:  # this loop cannot keep up: do not burst later
                    lagged += 1
                    d.due = now + period
            for name, n in (("published", published), ("skipped", skipped), ("lagged", lagged),
                            ("held", held)):
                if n:
                    with counters[name].get_lock():
                        counters[name].value += n
        for key, mask in sel.select(timeout):
            d = key.data
            if mask & selectors.EVENT_READ:
                d.client.loop_read()
            if mask & selectors.EVENT_WRITE and d.client.socket() is not None:
                d.client.loop_write()
            if d.client.socket() is None:  # the broker closed the connection
                sel.unregister(key.fileobj)
                d.connected, d.events = False, 0
                with counters["dropped"].get_lock():
                    counters["dropped"].value += 1
        for d in [watch, *devices]:
            if not d.events:
                continue
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if d.client.want_write() else 0)
            if want != d.events:
                d.events = want
                sel.modify(d.client.socket(), want, d)
        if received[0]:
            with counters["downlink_bytes"].get_lock():
                counters["downlink_bytes"].value += received[0]
            received[0] = 0
        if now >= next_misc:
            for d in [watch, *devices]:
                if d.events:
                    d.client.loop_misc()
            next_misc = now + 1.0
    for d in devices:
        with contextlib.suppress(Exception):
            d.client.disconnect()
    with contextlib.suppress(Exception):
        watcher.disconnect()
