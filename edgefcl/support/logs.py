"""Logging set-up: readable lines by default, one JSON object per line with --log-json."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname,
                 "logger": record.name, "message": clipped(record.getMessage())}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


MAX_LINE = 1000
"""The most characters of a log message a formatter writes: ids and topics a device made up
cannot make a line longer (the cut says how much it left out)."""


def clipped(text: str) -> str:
    """`text` cut at MAX_LINE characters, saying how many it left out."""
    if len(text) <= MAX_LINE:
        return text
    return f"{text[:MAX_LINE]}... ({len(text) - MAX_LINE} characters left out)"


def one_line(text: str) -> str:
    """`text` with every non-printable character escaped (a newline as \\n, ESC as \\x1b):
    what a device sent can neither forge a log line nor drive a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class PlainFormatter(logging.Formatter):
    """Readable lines: the message cut by `clipped` and escaped by `one_line` (the ids and
    fields a daemon quotes come from devices); a traceback that follows is the process's own
    and stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = clipped(one_line(clipped(message)))  # escapes can lengthen it
        try:
            return super().formatMessage(record)
        finally:
            record.message = message


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (it may be replaced after set-up, e.g.
    by a test's capture), never to a stream that has since been closed."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


DEVICE_KEYS = 1024
"""Devices whose warnings `Repeats` counts apart (beyond, a device shares its template's)."""


class Repeats(logging.Filter):
    """Lets through at most `burst` warnings of one message template (the format string, not
    its values: what devices send cannot make new templates) and one device (a record's
    `device`, when the call names one) per `window` seconds, and as many info lines that name
    a device; the others are left out and counted, and the next one let through says how
    many. A device sending a rejected message 50 times a second wrote a warning line for
    each: the log grew with what it sent; counted by template alone, 20 rejections a minute of
    one device hid every other device's; a device's statuses that each announced a new
    incarnation wrote an info line each. Other lines all pass (a round's line, an error), and
    the daemons' status counts every rejection by reason either way. Devices are counted
    apart up to DEVICE_KEYS at a time (those whose window ended make room)."""

    def __init__(self, burst: int = 20, window: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self._seen: dict[tuple[str, str, str | None], tuple[float, int, int]] = {}
        """(logger, template, device) -> (window start, records let through in it, left
        out)."""
        self._devices = 0  # keys with a device
        self._pruned = float("-inf")  # when expired device keys were last removed

    def _key(self, record: logging.LogRecord) -> tuple[str, str, str | None]:
        device = getattr(record, "device", None)
        key = (record.name, record.msg, None if device is None else str(device)[:256])
        if device is None or key in self._seen or self._devices < DEVICE_KEYS:
            return key
        if record.created - self._pruned >= 1.0:  # make room, at most once a second
            self._pruned = record.created
            for k, (start, _, left_out) in list(self._seen.items()):
                if k[2] is not None and record.created - start >= self.window and not left_out:
                    del self._seen[k]
                    self._devices -= 1
        return key if self._devices < DEVICE_KEYS else (record.name, record.msg, None)

    def filter(self, record: logging.LogRecord) -> bool:
        limited = record.levelno == logging.WARNING or (
            record.levelno == logging.INFO and getattr(record, "device", None) is not None)
        if not limited or not isinstance(record.msg, str):
            return True
        key = self._key(record)
        if key not in self._seen and key[2] is not None:
            self._devices += 1
        start, shown, left_out = self._seen.get(key, (record.created, 0, 0))
        if record.created - start >= self.window:
            start, shown = record.created, 0
        if shown >= self.burst:
            self._seen[key] = (start, shown, left_out + 1)
            return False
        self._seen[key] = (start, shown + 1, 0)
        if left_out and isinstance(record.args, tuple):
            record.msg += " (%d more like this left out)"
            record.args = (*record.args, left_out)
        return True


def setup_logging(level: int, as_json: bool = False) -> None:
    """Configure the root logger on stderr (repeated warnings rate-limited: `Repeats`)."""
    handler = _StderrHandler()
    handler.addFilter(Repeats())
    handler.setFormatter(JsonFormatter() if as_json else PlainFormatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
