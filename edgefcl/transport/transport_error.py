"""The error of a failed transport operation, apart from the MQTT link so that the command
line can catch it on a machine without paho-mqtt (a GPU box for studies)."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transport operation that failed; the message says what to check."""
