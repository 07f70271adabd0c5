"""The device's radio: a link model enforced by a local TCP proxy between the device's MQTT
client and the broker.

The device's unmodified MqttLink connects to `Radio.url` instead of the broker. The proxy
forwards the bytes both ways and applies the profile's [link] model:
- latency and bandwidth: a chunk of n bytes read at time r starts transmitting when the
  direction is free, takes 8n / (1000 kbps) seconds, and is delivered `latency` after that
  (`Pipe.schedule`); order is preserved;
- availability: the link is up when the duty cycle is in its on-window, no random drop is
  running and no cut was forced (`LinkModel.up`). When it goes down every connection is
  aborted (TCP reset, both sides: the broker publishes the device's last will, paho sees a
  dropped connection and reconnects with its back-off) and new connections are refused until
  it is up again. Bytes in flight are lost, as on a real radio.
Clocks are `time.monotonic()`; all proxies of a process share one asyncio loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import Counter

from edgefcl.transport.mqtt import parse_url
from firmware_sim.profile import LinkProfile

log = logging.getLogger("firmware_sim.radio")

CHUNK = 16384
POLL_S = 0.05
WINDOW = 32768
"""Bytes a shaped direction buffers before it stops reading (TCP flow control then pushes
back on the sender, as on a real slow link)."""
IDLE_BYTES = 1024
"""Uplink backlog under which the radio counts as idle (`tx_idle`)."""


def transfer_s(nbytes: int, kbps: float) -> float:
    """Seconds to push `nbytes` through a `kbps` kilobit/s link (0 kbps: no cap)."""
    return 0.0 if kbps <= 0 else nbytes * 8.0 / (kbps * 1000.0)


class Pipe:
    """One direction of the link: FIFO transmission at a bandwidth cap, then latency."""

    def __init__(self, latency_s: float, kbps: float) -> None:
        self.latency_s = latency_s
        self.kbps = kbps
        self.free_at = 0.0

    def schedule(self, now: float, nbytes: int) -> float:
        """Delivery time of `nbytes` handed to the link at `now`."""
        start = max(now, self.free_at)
        self.free_at = start + transfer_s(nbytes, self.kbps)
        return self.free_at + self.latency_s


def duty_on(t: float, period: float, on: float, phase: float = 0.0) -> bool:
    """Whether a duty cycle of `on` seconds every `period` (starting at `phase`) is on at t."""
    return period <= 0 or (t - phase) % period < on


class LinkModel:
    """Availability of one device's link over time: duty cycle, random drops, forced cuts.

    Random drops form a Poisson process of `disconnects_per_min`; each lasts an exponential
    time of mean `disconnect_s`. `rng` makes a device's drops reproducible.
    """

    def __init__(self, profile: LinkProfile, rng: random.Random, start: float) -> None:
        self.p = profile
        self.rng = rng
        self.phase = start - rng.uniform(0, profile.duty_period_s) if profile.duty_period_s \
            else start
        self.down_until = start
        self.cut_until = start
        self.next_drop = self._draw_drop(start)
        self.drops = 0
        self.cuts = 0

    def _draw_drop(self, t: float) -> float:
        rate = self.p.disconnects_per_min / 60.0
        return t + self.rng.expovariate(rate) if rate > 0 else float("inf")

    def cut(self, now: float, seconds: float) -> None:
        """Force the link down for `seconds` from `now`."""
        self.cut_until = max(self.cut_until, now + seconds)
        self.cuts += 1

    def up(self, t: float) -> bool:
        """Whether the link is up at time t (call with non-decreasing t)."""
        while t >= self.next_drop:
            self.down_until = max(self.down_until,
                                  self.next_drop + self.rng.expovariate(1 / self.p.disconnect_s))
            self.drops += 1
            self.next_drop = self._draw_drop(self.next_drop)
        return (t >= self.down_until and t >= self.cut_until
                and duty_on(t, self.p.duty_period_s, self.p.duty_on_s, self.phase))


class RadioLoop:
    """One asyncio event loop on a daemon thread, shared by the radios of a process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="firmware-radio",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the loop (its radios must be closed first)."""
        self.loop.call_soon_threadsafe(self.loop.stop)

    def call(self, coro, timeout: float = 10.0):
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)



class Radio:
    """A TCP proxy to `broker_url` that applies a LinkModel; `url` is what the device dials."""

    def __init__(self, loop: RadioLoop, broker_url: str, profile: LinkProfile,
                 seed: int = 0) -> None:
        self.rl = loop
        self.host, self.port, tls, _, _ = parse_url(broker_url)
        if tls:
            raise ValueError("the simulated radio proxies plain MQTT (mqtt://) only")
        self.profile = profile
        self.model = LinkModel(profile, random.Random(seed), time.monotonic())
        self.conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.counters: Counter[str] = Counter()
        self.backlog: Counter[str] = Counter()  # bytes read but not yet delivered, per direction
        self.server: asyncio.AbstractServer | None = None
        self._watch: asyncio.Task | None = None
        self.listen_port = 0

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.listen_port}"

    def start(self) -> Radio:
        self.rl.call(self._start())
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.listen_port = self.server.sockets[0].getsockname()[1]
        self._watch = asyncio.get_running_loop().create_task(self._watchdog())

    def tx_idle(self) -> bool:
        """Whether the link is up and has (almost) nothing left to send upstream: the
        firmware's 'radio ready' flag."""
        return bool(self.conns) and self.backlog["bytes_up"] < IDLE_BYTES

    def cut(self, seconds: float) -> None:
        """Force the link down for `seconds`; live connections are reset before it returns."""
        async def do() -> None:
            self.model.cut(time.monotonic(), seconds)
            self._drop_all("cut")
        self.rl.call(do())

    def close(self) -> None:
        """Stop listening and drop every connection."""
        async def stop() -> None:
            if self._watch is not None:
                self._watch.cancel()
            if self.server is not None:
                self.server.close()
            self._drop_all("close")
        with contextlib.suppress(Exception):
            self.rl.call(stop())

    # -- internals (on the loop thread) ---------------------------------------------------
    def _drop_all(self, why: str) -> None:
        for down, up in list(self.conns):
            down.transport.abort()
            up.transport.abort()
            self.counters[f"dropped_{why}"] += 1
        self.conns.clear()
        self.backlog.clear()

    async def _watchdog(self) -> None:
        was_up = True
        while True:
            up = self.model.up(time.monotonic())
            if not up and self.conns:
                self._drop_all("down")
            if up != was_up:
                self.counters["went_down" if not up else "came_up"] += 1
                was_up = up
            await asyncio.sleep(POLL_S)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.model.up(time.monotonic()):
            self.counters["refused"] += 1
            writer.transport.abort()
            return
        try:
            ureader, uwriter = await asyncio.open_connection(self.host, self.port)
        except OSError:
            self.counters["broker_unreachable"] += 1
            writer.transport.abort()
            return
        pair = (writer, uwriter)
        self.conns.add(pair)
        self.counters["connections"] += 1
        lat = self.profile.latency_ms / 1000.0
        kbps = self.profile.bandwidth_kbps
        await asyncio.gather(self._pump(reader, uwriter, Pipe(lat, kbps), "bytes_up", pair),
                             self._pump(ureader, writer, Pipe(lat, kbps), "bytes_down", pair),
                             return_exceptions=True)
        self.conns.discard(pair)
        if not self.conns:
            self.backlog.clear()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pipe: Pipe,
                    counter: str, pair: tuple) -> None:
        """Copy src to dst through `pipe`; closing either side closes the connection."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        shaped = pipe.latency_s > 0 or pipe.kbps > 0

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    break
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                dst.write(data)
                await dst.drain()
                self.counters[counter] += len(data)
                self.backlog[counter] -= len(data)

        writer_task = asyncio.get_running_loop().create_task(deliver()) if shaped else None
        try:
            while data := await src.read(CHUNK):
                if writer_task is None:
                    dst.write(data)
                    await dst.drain()
                    self.counters[counter] += len(data)
                else:
                    self.backlog[counter] += len(data)
                    queue.put_nowait((pipe.schedule(time.monotonic(), len(data)), data))
                    while self.backlog[counter] > WINDOW and pair in self.conns:
                        await asyncio.sleep(POLL_S / 5)
            if writer_task is not None:
                queue.put_nowait((0.0, b""))
                await writer_task
        except (ConnectionError, OSError):
            pass
        finally:
            if writer_task is not None:
                writer_task.cancel()
            for w in pair:
                w.transport.abort()
