"""A plain subscriber that only counts the updates the broker delivers (QoS 1, like the
aggregator): the raw broker rate the aggregator tier is compared with."""

from __future__ import annotations

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def run_counter(host: str, port: int, pattern: str, count, ready, stop) -> None:
    """Process main: subscribe to `pattern` and add 1 to `count` per message until `stop`."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw-counter",
                    protocol=mqtt.MQTTv311, clean_session=True)

    def on_connect(client, userdata, flags, reason, properties) -> None:
        client.subscribe(pattern, qos=1)

    def on_message(client, userdata, msg) -> None:
        count.value += 1  # one writer: no lock needed

    c.on_connect, c.on_message = on_connect, on_message
    c.on_subscribe = lambda *a: ready.set()
    c.connect(host, port, keepalive=60)
    while not stop.is_set():
        c.loop(timeout=0.1)
    c.disconnect()
