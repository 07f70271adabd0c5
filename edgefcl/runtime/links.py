"""Build MQTT links and topic sets from the `[mqtt]` config section."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from edgefcl.config import MqttConfig, RunConfig, split_credentials
from edgefcl.data.labels import MAX_LABEL_CHARS, MAX_LABELS
from edgefcl.federation.heads import library_width
from edgefcl.federation.registry import get_encoding
from edgefcl.federation.strategy import MAX_ROUND_CLASSES
from edgefcl.transport.bounds import DEFAULT_LIMITS, STATUS_LIMITS, Limits
from edgefcl.transport.codec import DEFAULT_MAX_BYTES, CodecError, Message, decode
from edgefcl.transport.mqtt import MqttLink
from edgefcl.transport.partials import MAX_PARTIAL_COUNTERS
from edgefcl.transport.topics import STATUS_KINDS, UPDATE_KINDS, Topics


def topics(m: MqttConfig) -> Topics:
    return Topics(m.fleet, m.topic_root)


def wire_dtype(m: MqttConfig) -> str | None:
    """The codec's wire dtype for the configured float width."""
    return "<f2" if m.wire_dtype == "float16" else None


def payload_limit(cfg: RunConfig, tensors: dict[str, np.ndarray]) -> int:
    """The largest payload a process of this run accepts (`[mqtt] max_payload`, or sized from
    the model when 0): 4 x the model's float32 bytes (dense, Gaussian mean and sigma, sparse
    values and indices), the apc knowledge base, the largest prototype library (1,024 labels,
    rows and variances) and 1 MiB for the envelope. Bounds what one sender can make a daemon
    or a device hold: the inbox, pending chunks and a decode are all sized from it."""
    if cfg.mqtt.max_payload > 0:
        return cfg.mqtt.max_payload
    model = sum(4 * int(np.size(t)) for t in tensors.values())
    kb = cfg.fed.apc_kb_size * model if get_encoding(cfg.fed.encoding).knowledge_base else 0
    width = library_width(cfg, tensors)
    library = 0 if width is None else MAX_LABELS * (2 * 4 * width + 4 * MAX_LABEL_CHARS + 16)
    return 4 * model + kb + library + (1 << 20)


ENVELOPE_OBJECTS = 256
"""msgpack objects an update may spend outside its tensors and labels (envelope fields)."""
OBJECTS_PER_TENSOR = 64
"""msgpack objects an update may spend per model tensor: up to 4 wire tensors (dense; a sparse
tensor's values and index; Gaussian mean and sigma; an apc knowledge-base pair) of at most 16
objects each (name, map, dtype, shape, data). Measured: 10-12 a wire tensor (the demo model's
dense update 208 objects for 18 tensors, Gaussian 275, sparse ResNet-18 1,156)."""


def update_limits(tensors: Mapping[str, np.ndarray]) -> Limits:
    """The structure limits of an update of a model with these tensors: ENVELOPE_OBJECTS,
    OBJECTS_PER_TENSOR a tensor and 4 per label of the largest label set (class counts and a
    prototype library's labels), within the codec's defaults. The scan of a payload stops at
    its limit, about 0.5 us an object: under the default 16,384 objects a device's made-up
    update cost the main loop 8 ms (the demo model's updates need 208), so one device at its
    inbox rate (50/s) took 41-49 % of it."""
    objects = ENVELOPE_OBJECTS + OBJECTS_PER_TENSOR * len(tensors) + 4 * MAX_LABELS
    return replace(DEFAULT_LIMITS, max_objects=min(objects, DEFAULT_LIMITS.max_objects))


def partial_limits(tensors: Mapping[str, np.ndarray], by_class: bool, cap: int) -> Limits:
    """The structure limits a root decodes a worker's partial with: up to 4 sums a model
    tensor (a Gaussian rule's), for each of MAX_ROUND_CLASSES + 1 classes under a rule that
    weighs by class, the ids and sequence numbers of up to `cap` participants and the
    worker's counters; at least the codec's defaults. Partials come from workers only (the
    ACL), and an honest class-weighted one of a 100-tensor model with 19 classes was past the
    defaults: the root rejected every update in it."""
    arrays = 4 * len(tensors) * (MAX_ROUND_CLASSES + 1 if by_class else 1) + 64
    objects = ENVELOPE_OBJECTS + 16 * arrays + 4 * cap + 2 * MAX_PARTIAL_COUNTERS
    return replace(DEFAULT_LIMITS, max_tensors=max(arrays, DEFAULT_LIMITS.max_tensors),
                   max_objects=max(objects, DEFAULT_LIMITS.max_objects))


def message_limits(kinds: frozenset[str], updates: Limits) -> Limits:
    """The structure limits a daemon scans a message on a topic that admits `kinds` with:
    a status's, `updates` (`update_limits`) on a device's update topic, else the defaults."""
    if kinds == STATUS_KINDS:
        return STATUS_LIMITS
    return updates if kinds == UPDATE_KINDS else DEFAULT_LIMITS


def status_body(payload: bytes, fleet: str) -> dict | None:
    """A status's body, decoded under the status limits (None: not a valid status of `fleet`;
    its fields are still the sender's claims)."""
    try:
        msg = decode(payload, fleet, limits=STATUS_LIMITS)
    except (CodecError, ValueError):
        return None
    return msg.body if isinstance(msg, Message) and msg.kind == "status" else None


def size_payload_limit(cfg: RunConfig, tensors: dict[str, np.ndarray]) -> int:
    """Fix `cfg.mqtt.max_payload` to `payload_limit` (once per process, before links open)."""
    cfg.mqtt.max_payload = payload_limit(cfg, tensors)
    return cfg.mqtt.max_payload


def inbox_budget(m: MqttConfig) -> int:
    """A daemon's inbox budget: four of the largest payloads, at least 32 MiB."""
    return max(32 << 20, 4 * (m.max_payload or DEFAULT_MAX_BYTES))


PASSWORD_VARIABLE = "EDGEFCL_MQTT_PASSWORD"
"""The device broker's password, when `[mqtt] password` is empty."""
UPSTREAM_PASSWORD_VARIABLE = "EDGEFCL_UPSTREAM_PASSWORD"
"""The password of a worker's or site's login to its root's broker (`--upstream`)."""


def upstream_config(m: MqttConfig, url: str) -> MqttConfig:
    """The MQTT settings of a worker's or site's link to its root's broker at `url`: the login
    written in `url` (its password there or in UPSTREAM_PASSWORD_VARIABLE; none: anonymous)
    and TLS as its scheme says (mqtts: checked against `tls_ca`, else the system's CAs; the
    certificate always checked). Nothing of the device broker's login or TLS identity (its
    client certificate and key): they must never reach another host."""
    bare, user, password = split_credentials(url)
    tls = bare.startswith("mqtts://")
    return replace(m, broker=bare, username=user,
                   password=(password or os.environ.get(UPSTREAM_PASSWORD_VARIABLE, ""))
                   if user else "", tls_ca=m.tls_ca if tls else "", tls_cert="", tls_key="",
                   tls_no_verify=False, tls_no_hostname_check=False)


def open_link(m: MqttConfig, client_id: str, *, will: tuple[str, bytes, int, bool] | None = None,
              clean_start: bool = False, connect: bool = True,
              on_reject: Callable[[str, CodecError], None] | None = None,
              protocol: str = "3.1.1",
              password_variable: str | None = PASSWORD_VARIABLE) -> MqttLink:
    """An MqttLink configured from `m` (credentials, TLS, chunking), connected unless asked not;
    an empty password is read from `password_variable` (None: not read: `upstream_config`).

    The production broker binds a session to its login (`use_username_as_clientid` in
    broker/mosquitto.conf), so one device cannot take over another's session; the client id
    asked for here only names the connection where the broker does not. `protocol="5"` is
    needed for shared subscriptions (aggregator workers)."""
    password = m.password or (os.environ.get(password_variable, "") if password_variable else "")
    link = MqttLink(
        m.broker, client_id, username=m.username or None, password=password or None,
        tls_ca=m.tls_ca or None, tls_cert=m.tls_cert or None, tls_key=m.tls_key or None,
        tls_verify=not m.tls_no_verify, tls_check_hostname=not m.tls_no_hostname_check,
        clean_start=clean_start, will=will,
        chunk_size=m.chunk_size, max_bytes=m.max_payload or DEFAULT_MAX_BYTES, on_reject=on_reject,
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

    def counters(self) -> dict[str, int]:
        return {}
