"""A thin MQTT link over paho-mqtt 2.x: connect, publish (chunked), subscribe, reconnect.

Protocol choice: MQTT 3.1.1 is the default because every broker speaks it (the embedded amqtt
broker speaks nothing else) and a persistent session is simply `clean_session=False`. With
`protocol="5"` the link asks for `clean_start=False` plus a session expiry interval, which is
what MQTT 5 needs for the same persistence (and is required for shared subscriptions).

Persistent sessions (`clean_start=False`, the default) make the broker queue QoS 1 messages
for a subscriber while it is offline; messages published while this link is offline are
held and sent after the automatic reconnect.

Order: what one link publishes reaches the broker in the order it was published, across
reconnects too. paho resends its unacknowledged messages only after the connection's callback
has run, so a message handed to it in between would overtake them (a device then drops the
older stream batch as a redelivery). The link therefore holds every publish from the loss of
a connection until the broker has answered a packet sent after that resend: the SUBACK of the
last renewed subscription, or the UNSUBACK of a no-op unsubscribe (`SYNC_TOPIC`) on a link
that subscribes to nothing.

Callbacks run on paho's network thread: handlers must be quick or hand work to a queue.
"""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgefcl.transport.chunks import DEFAULT_CHUNK_SIZE, Reassembler, is_chunk, split
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, CodecError
from edgefcl.transport.transport_error import TransportError

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]
DEFAULT_PORTS = {"mqtt": 1883, "tcp": 1883, "mqtts": 8883, "ssl": 8883}
CONNECT_BACKOFF_S = 0.1  # first wait after a refused connection; doubles up to the maximum
CONNECT_BACKOFF_MAX_S = 2.0
SYNC_TOPIC = "$edgefcl/sync"  # never subscribed: its UNSUBACK marks the end of paho's resend
CLOSE_WAIT_S = 5.0  # how long `close` waits to hand over publishes held for a resend
HOW_TO_START = (
    "start one with `edgefcl broker` (embedded, for a laptop) or "
    "`mosquitto -c broker/mosquitto.conf` (see broker/README.md)"
)


class BrokerUnavailable(TransportError):
    """The broker could not be reached or refused the connection."""


def parse_url(url: str) -> tuple[str, int, bool, str | None, str | None]:
    """`mqtt://[user:pass@]host[:port]` -> (host, port, tls, username, password)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(
            f"broker url {url!r} must look like mqtt://host:port or mqtts://host:port"
        )
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError as e:
        raise ValueError(f"broker url {url!r} has an invalid port: {e}") from None
    user = unquote(parts.username) if parts.username else None
    pw = unquote(parts.password) if parts.password else None
    return parts.hostname, port, scheme in ("mqtts", "ssl"), user, pw


def _match_pattern(pattern: str) -> str:
    """The topic filter a shared subscription `$share/<group>/<filter>` matches against."""
    if pattern.startswith("$share/"):
        return pattern.split("/", 2)[2]
    return pattern


class MqttLink:
    """One MQTT connection with chunked publish, handler dispatch and automatic reconnect.

    Chunked payloads that fail reassembly (digest mismatch, over `max_bytes`) never reach a
    handler: they are counted in `rejected` and reported to `on_reject(topic, CodecError)`.
    """

    def __init__(
        self,
        broker_url: str,
        client_id: str,
        *,
        username: str | None = None,
        password: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_verify: bool = True,
        tls_check_hostname: bool = True,
        clean_start: bool = False,
        will: tuple[str, bytes, int, bool] | None = None,
        keepalive: int = 30,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_bytes: int = DEFAULT_MAX_BYTES,
        protocol: str = "3.1.1",
        session_expiry: int = 7 * 24 * 3600,
        reconnect_delay: tuple[int, int] = (1, 30),
        on_reject: Callable[[str, CodecError], None] | None = None,
    ) -> None:
        if protocol not in ("3.1.1", "5"):
            raise ValueError(f"protocol must be '3.1.1' or '5', got {protocol!r}")
        if not client_id:
            raise ValueError("client_id must be a non-empty string")
        self.host, self.port, tls, url_user, url_pw = parse_url(broker_url)
        self.url = f"{'mqtts' if tls else 'mqtt'}://{self.host}:{self.port}"  # no credentials
        self.client_id = client_id
        self.chunk_size = chunk_size
        self.protocol = protocol
        self.clean_start = clean_start
        self.keepalive = keepalive
        self.session_expiry = session_expiry
        v5 = protocol == "5"
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=None if v5 else clean_start,
            protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
        )
        self._client.reconnect_delay_set(*reconnect_delay)
        self._client.max_queued_messages_set(0)
        user, pw = username or url_user, password or url_pw
        if user is not None:
            self._client.username_pw_set(user, pw)
        if tls or tls_ca or tls_cert:
            for flag, path in (("--tls-ca", tls_ca), ("--tls-cert", tls_cert),
                               ("--tls-key", tls_key)):
                if path and not os.path.isfile(path):
                    raise TransportError(f"{flag} {path}: no such file")
            try:
                self._client.tls_set(
                    ca_certs=tls_ca, certfile=tls_cert, keyfile=tls_key,
                    cert_reqs=ssl.CERT_REQUIRED if tls_verify else ssl.CERT_NONE,
                )
            except (OSError, ssl.SSLError) as e:  # not a certificate, a key that does not fit
                raise TransportError(f"TLS files {tls_ca or ''} {tls_cert or ''} "
                                     f"{tls_key or ''}: {e}") from None
            self._client.tls_insecure_set(not (tls_verify and tls_check_hostname))
        if will is not None:
            topic, payload, qos, retain = will
            self._client.will_set(topic, payload, qos, retain)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._client.on_unsubscribe = self._on_unsubscribe
        self._handlers: list[tuple[str, str, Handler, int]] = []
        self._reassembler = Reassembler(max_bytes=max_bytes)
        self.on_reject = on_reject
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._refused: str | None = None
        self._answered = threading.Event()
        self._subacks: dict[int, list] = {}
        self._suback_cond = threading.Condition()
        self._connect_mids: list[tuple[int, str]] = []
        self._unacked: set[int] = set()  # this connection's renewed subscriptions, no SUBACK yet
        self._ready = threading.Event()  # connected and every renewed subscription answered
        # publishes made while not ready, in order (see the module docstring), and the lock
        # under which `_ready` is set only once they are handed to paho
        self._held: deque[tuple[str, bytes, int, bool]] = deque()
        self._held_lock = threading.Lock()
        self._sync_mid: int | None = None
        self._watchdog: threading.Timer | None = None  # releases what a silent broker holds
        self._generation = 0  # connections so far: a SUBACK wait follows a reconnect
        self._ever_connected = False
        self._started = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.reconnects = 0
        self.rejected = 0
        self.handler_errors = 0

    # ------------------------------------------------------------ lifecycle

    @property
    def is_connected(self) -> bool:
        """True while the broker connection is up."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until the connection is up (e.g. after a reconnect) and the broker has answered
        (SUBACK) every subscription the connection renewed, so that nothing published from then
        on is missed; a refused one (ACL) is logged. False on timeout."""
        return self._ready.wait(timeout)

    def connect(self, timeout: float = 10.0) -> MqttLink:
        """Connect and start the network thread; raise BrokerUnavailable on failure."""
        if self._started:
            return self
        where = f"{self.host}:{self.port}"
        self._answered.clear()
        self._refused = None
        self._client.connect_timeout = timeout
        kwargs: dict = {}
        if self.protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0 if self.clean_start else self.session_expiry
            kwargs = {"clean_start": self.clean_start, "properties": props}
        deadline = time.monotonic() + timeout
        delay = CONNECT_BACKOFF_S
        while True:
            try:
                self._client.connect(self.host, self.port, self.keepalive, **kwargs)
                break
            except ssl.SSLError as e:
                raise BrokerUnavailable(
                    f"TLS handshake with the MQTT broker at {where} failed ({e}); check tls_ca, "
                    "tls_cert and tls_key (tls_no_verify=True skips verification, for tests only)"
                ) from None
            except OSError as e:  # refused or unreachable: a broker still starting, retried
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(
                        f"cannot reach the MQTT broker at {where} within {timeout:g} s ({e}); "
                        f"{HOW_TO_START}"
                    ) from None
                if delay == CONNECT_BACKOFF_S:
                    log.info("waiting for the MQTT broker at %s (%s), up to %g s", where, e,
                             timeout)
                time.sleep(min(delay, left))
                delay = min(2 * delay, CONNECT_BACKOFF_MAX_S)
        self._client.loop_start()
        self._started = True
        if not self._answered.wait(timeout) or self._refused is not None:
            reason = self._refused or f"no answer (CONNACK) within {timeout:g} s"
            self.close()
            hint = ("; check the username/password and ACL" if self._refused else
                    "; this link speaks MQTT 5, which the broker may not (the embedded "
                    "`edgefcl broker` speaks 3.1.1 only: use Mosquitto)"
                    if self.protocol == "5" else "")
            raise BrokerUnavailable(
                f"MQTT broker at {where} did not accept client {self.client_id!r}: {reason}"
                + hint
            )
        try:
            with self._suback_cond:
                patterns = [p for _, p in self._connect_mids]
            for pattern in patterns:
                self._wait_suback(pattern, timeout)
        except TransportError:
            self.close()
            raise
        self._ready.wait(timeout)  # a link without subscriptions: the no-op's answer
        return self

    def close(self) -> None:
        """Disconnect cleanly (the will is not sent) and stop the network thread; publishes
        still held for a reconnect's resend go out first (for up to CLOSE_WAIT_S), the rest
        are dropped."""
        if not self._started:
            return
        if self._connected.is_set() and self._held:
            self._ready.wait(CLOSE_WAIT_S)
        self._started = False
        # also when offline: moves paho out of its reconnect wait so loop_stop returns at once
        self._client.disconnect()
        self._client.loop_stop()
        with self._held_lock:
            self._connected.clear()
            self._ready.clear()
            self._held.clear()
        self._cancel_watchdog()

    def __enter__(self) -> MqttLink:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ paho callbacks

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.warning("broker %s:%s refused %s: %s", self.host, self.port, self.client_id,
                        reason_code)
            self._answered.set()
            return
        self._refused = None
        if self._ever_connected:
            with self._lock:
                self.reconnects += 1
            log.info("reconnected to %s:%s (session present: %s)", self.host, self.port,
                     flags.session_present)
        self._ever_connected = True
        with self._lock:
            subs = [(p, q) for p, _, _, q in self._handlers]
        mids = [(client.subscribe(pattern, qos)[1], pattern) for pattern, qos in dict(subs).items()]
        with self._suback_cond:
            self._connect_mids = mids
            self._unacked = {m for m, _ in mids}
            self._generation += 1
            self._suback_cond.notify_all()
            if not self._unacked:  # nothing to renew: a no-op's answer marks the same point
                self._sync_mid = client.unsubscribe(SYNC_TOPIC)[1]
            generation = self._generation
        self._connected.set()  # ready once answered (on this thread, after paho's resend)
        self._answered.set()
        self._cancel_watchdog()
        self._watchdog = threading.Timer(self.keepalive, self._unanswered, (generation,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _unanswered(self, generation: int) -> None:
        """A connection whose SUBACKs (or the no-op's UNSUBACK) never came: after `keepalive`
        seconds its held publishes go out anyway, said once."""
        if self._become_ready(generation):
            log.warning("broker %s:%s answered no subscription of %s within %d s: published "
                        "anyway", self.host, self.port, self.client_id, self.keepalive)

    def _become_ready(self, generation: int | None = None) -> bool:
        """Hand the held publishes to paho in order, then let new ones through, unless the
        connection (`generation`, when given) is gone or the link is ready already; whether
        it did."""
        with self._suback_cond:
            current = generation is None or generation == self._generation
        with self._held_lock:
            if not current or not self._connected.is_set() or self._ready.is_set():
                return False
            while self._held:
                topic, payload, qos, retain = self._held.popleft()
                self._client.publish(topic, payload, qos=qos, retain=retain)
            self._ready.set()
        self._cancel_watchdog()
        return True

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._suback_cond:
            if mid != self._sync_mid:  # an `unsubscribe()` of the user's
                return
            self._sync_mid = None
        self._become_ready()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if any(rc.is_failure for rc in reason_codes):
            log.warning("broker refused subscription %s of %s: %s (check the ACL)", mid,
                        self.client_id, [str(rc) for rc in reason_codes])
        with self._suback_cond:
            if len(self._subacks) > 1000:  # SUBACKs of reconnects nobody waits for
                self._subacks.clear()
            self._subacks[mid] = reason_codes
            last = mid in self._unacked and len(self._unacked) == 1
            self._unacked.discard(mid)
            self._suback_cond.notify_all()
        if last:
            self._become_ready()

    def _wait_suback(self, pattern: str, timeout: float, mid: int | None = None,
                     generation: int | None = None) -> None:
        """Wait for the broker to acknowledge the subscription of `pattern` (packet `mid`,
        sent on connection `generation`; default: the one `_on_connect` sent). If the link
        reconnects meanwhile, the old SUBACK is lost with the connection: wait for the
        subscription `_on_connect` renewed instead."""
        deadline = time.monotonic() + timeout
        with self._suback_cond:
            if mid is None or generation != self._generation:
                generation = -1  # look the pattern up among the current connection's
            while mid is None or mid not in self._subacks:
                if self._generation != generation:
                    generation = self._generation
                    mid = dict((p, m) for m, p in self._connect_mids).get(pattern, mid)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(f"no SUBACK for {pattern!r} within {timeout:g} s")
                self._suback_cond.wait(remaining)
            codes = self._subacks.pop(mid)
        if any(rc.is_failure for rc in codes):
            raise TransportError(
                f"broker refused subscription {pattern!r} for {self.client_id!r} "
                f"({codes[0]}); check the ACL"
            )

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        with self._held_lock:  # `_become_ready` checks the connection under this lock
            self._connected.clear()
            self._ready.clear()
        self._cancel_watchdog()
        if self._started:
            log.warning("lost connection to %s:%s (%s); reconnecting", self.host, self.port,
                        reason_code)

    def _on_message(self, client, userdata, msg: paho.MQTTMessage) -> None:
        payload = msg.payload
        with self._lock:
            self.bytes_received += len(payload)
            self.messages_received += 1
        if is_chunk(payload):
            try:
                with self._lock:
                    whole = self._reassembler.add(payload, source=msg.topic)
            except CodecError as e:
                with self._lock:
                    self.rejected += 1
                log.warning("rejected chunked payload on %s: %s", msg.topic, e,
                            extra={"device": msg.topic})
                if self.on_reject is not None:
                    try:
                        self.on_reject(msg.topic, e)
                    except Exception:
                        log.exception("on_reject callback failed")
                return
            if whole is None:
                return
            payload = whole
        self._dispatch(msg.topic, payload)

    def _dispatch(self, topic: str, payload: bytes) -> None:
        with self._lock:
            handlers = [h for _, m, h, _ in self._handlers if paho.topic_matches_sub(m, topic)]
        for handler in handlers:
            try:
                handler(topic, payload)
            except Exception:
                with self._lock:
                    self.handler_errors += 1
                log.exception("handler for %s failed", topic)

    # ------------------------------------------------------------ publish / subscribe

    def subscribe(
        self, pattern: str, handler: Handler, qos: int = 1, timeout: float = 10.0,
        wait: bool = True,
    ) -> None:
        """Call `handler(topic, payload)` for every (reassembled) message matching `pattern`.

        May be called before `connect()` (which then waits for the subscription); when
        connected, returns once the broker acknowledged it, so later messages are not missed
        (`wait=False` returns at once: required inside a handler, which runs on the network
        thread that receives the acknowledgement). Raises TransportError if the broker refuses
        it (ACL). Renewed on every reconnect.
        """
        with self._lock:
            self._handlers.append((pattern, _match_pattern(pattern), handler, qos))
        if self._connected.is_set():
            with self._suback_cond:
                generation = self._generation
            rc, mid = self._client.subscribe(pattern, qos)
            if rc == paho.MQTT_ERR_SUCCESS and wait:
                self._wait_suback(pattern, timeout, mid, generation)

    def unsubscribe(self, pattern: str) -> None:
        """Stop delivering `pattern` (its handlers are dropped; not renewed on reconnect)."""
        with self._lock:
            self._handlers = [h for h in self._handlers if h[0] != pattern]
        if self._connected.is_set():
            self._client.unsubscribe(pattern)

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
        wait: bool = False, timeout: float = 30.0,
    ) -> int:
        """Publish `payload`, split into chunks if above `chunk_size`; return bytes handed over.

        Retained payloads are never chunked (a broker retains one message per topic), so the
        broker's packet limit must admit them. With `wait=True` block until the broker
        acknowledged every part (QoS >= 1) or raise TransportError after `timeout` seconds.
        """
        parts = [payload] if retain else split(payload, self.chunk_size, secrets.token_hex(8))
        deadline = time.monotonic() + timeout
        while True:
            if wait and not self._ready.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError(f"not connected to {self.host}:{self.port}; cannot publish")
            with self._held_lock:
                if self._ready.is_set():  # nothing held: straight to paho
                    infos = [self._client.publish(topic, p, qos=qos, retain=retain)
                             for p in parts]
                    break
                if not wait:  # sent in order once the link is ready again
                    self._held.extend((topic, p, qos, retain) for p in parts)
                    infos = []
                    break
        nbytes = sum(len(p) for p in parts)
        with self._lock:
            self.bytes_sent += nbytes
            self.messages_sent += len(parts)
        if wait:
            for info in infos:
                try:
                    info.wait_for_publish(timeout)
                except (RuntimeError, ValueError) as e:
                    raise TransportError(f"publish to {topic} failed: {e}") from None
                if not info.is_published():
                    raise TransportError(
                        f"publish to {topic} not acknowledged within {timeout:g} s"
                    )
        return nbytes

    def limit_payload(self, max_bytes: int) -> None:
        """Lower (or raise) the largest reassembled payload, and the pending-chunk budget
        (2 x it), once the model that sizes them is known."""
        self._reassembler.max_bytes = max_bytes
        self._reassembler.max_pending_bytes = 2 * max_bytes

    def expire_pending(self) -> int:
        """Drop chunked transfers idle for longer than the reassembler's timeout (call it
        periodically: a sender that stops mid-transfer must not pin memory); returns how
        many were dropped."""
        with self._lock:
            return self._reassembler.expire()

    def counters(self) -> dict[str, int]:
        """Traffic counters (payload bytes, incl. chunk headers) and reconnects."""
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent,
                "messages_received": self.messages_received, "reconnects": self.reconnects,
                "rejected": self.rejected, "handler_errors": self.handler_errors,
                "chunks_dropped": self._reassembler.dropped,
            }
