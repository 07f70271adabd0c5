"""Build MQTT links and topic sets from the `[mqtt]` config section."""

from __future__ import annotations

import os
from collections.abc import Callable

from edgefcl.config import MqttConfig
from edgefcl.transport.codec import CodecError
from edgefcl.transport.mqtt import MqttLink
from edgefcl.transport.topics import Topics


def topics(m: MqttConfig) -> Topics:
    return Topics(m.fleet, m.topic_root)


def wire_dtype(m: MqttConfig) -> str | None:
    """The codec's wire dtype for the configured float width."""
    return "<f2" if m.wire_dtype == "float16" else None


def open_link(m: MqttConfig, client_id: str, *, will: tuple[str, bytes, int, bool] | None = None,
              clean_start: bool = False, connect: bool = True,
              on_reject: Callable[[str, CodecError], None] | None = None,
              protocol: str = "3.1.1") -> MqttLink:
    """An MqttLink configured from `m` (credentials, TLS, chunking), connected unless asked not.

    With a username the client id IS the username (the broker enforces it with
    `use_username_as_clientid`, so one device cannot take over another's session).
    `protocol="5"` is needed for shared subscriptions (aggregator workers)."""
    password = m.password or os.environ.get("EDGEFCL_MQTT_PASSWORD", "")
    client_id = m.username or client_id
    link = MqttLink(
        m.broker, client_id, username=m.username or None, password=password or None,
        tls_ca=m.tls_ca or None, tls_cert=m.tls_cert or None, tls_key=m.tls_key or None,
        tls_insecure=m.tls_insecure, clean_start=clean_start, will=will,
        chunk_size=m.chunk_size, max_bytes=m.max_payload, on_reject=on_reject,
        protocol=protocol,
    )
    if connect:
        link.connect(m.connect_timeout)
    return link


class NullLink:
    """A link that publishes nowhere: drives a daemon or a device runner in-process, with
    messages handed to its handlers directly (benchmarks, tests)."""

    reconnects = 0
    is_connected = True

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                wait: bool = False) -> int:
        return 0

    def subscribe(self, *a, **k) -> None:
        pass

    def unsubscribe(self, *a, **k) -> None:
        pass

    def expire_pending(self) -> int:
        return 0
