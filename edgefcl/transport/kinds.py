"""Every message kind of the protocol, in one table (`KINDS`): its wire form, the topic it
travels on, who sends it, and the checks the codec runs on its body.

- form `update`, `tick`, `global`: the codec's typed messages (`federation.messages`);
- form `map`: a `Message` whose body is a map, checked by the kind's `check` when decoded
  (`partial`, `claim` and `grant` further by `transport.partials`; what a device reads of
  `config`, `status` and `answer` by `runtime.bodies`);
- form `chunk`: one piece of a payload too large for one MQTT message (`transport.chunks`),
  reassembled before it is decoded.

Topics (`transport.topics`) accept on each per-client topic the kinds whose `topic` it is, and
the codec carries as maps exactly the kinds of form `map`. A new kind is one line here (and,
for a new form, its codec)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefcl.data.labels import MAX_LABEL_CHARS, MAX_LABELS, valid_name
from edgefcl.transport.codec_error import CodecError

CONTROL_COMMANDS = frozenset(["pause", "resume", "stop"])


def field(body: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    """`body[key]` when it is of `typ` (a bool is never an int, nor an int a bool), else
    CodecError("malformed")."""
    v = body.get(key)
    types = typ if isinstance(typ, tuple) else (typ,)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise CodecError("malformed", f"field {key!r} must be {names}, got {type(v).__name__}")
    return v


def _names(body: dict[str, Any], key: str, what: str) -> None:
    v = body.get(key)
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise CodecError("malformed", f"{what} {key} must be a list of strings")


def label_list(names: Any, what: str) -> list[str]:
    """`names` if it is a list of at most MAX_LABELS label names (`valid_name`)."""
    if not isinstance(names, list):
        raise CodecError("malformed", f"{what} must be a list of strings")
    if len(names) > MAX_LABELS:
        raise CodecError("limits", f"{len(names)} {what} > limit {MAX_LABELS}")
    if not all(valid_name(n) for n in names):
        raise CodecError("malformed", f"{what} must be strings of 1-{MAX_LABEL_CHARS} printable "
                         "characters")
    return names


def _stream_names(names: Any, y: np.ndarray) -> np.ndarray:
    """The labels of a named stream batch as a unicode array: `names` bounded like a
    library's (count, 1-MAX_LABEL_CHARS characters, distinct), `y` positions among them."""
    names = label_list(names, "stream names")
    if len(set(names)) != len(names):
        raise CodecError("malformed", "stream names must be distinct")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(names)):
        raise CodecError("shape", f"stream labels index {len(names)} names out of range")
    table = np.array(names, dtype=str) if names else np.zeros(0, "<U1")
    return table[y.astype(np.int64)]


def _control(body: dict[str, Any]) -> dict[str, Any]:
    command = body.get("command")
    if not (isinstance(command, str) and command in CONTROL_COMMANDS):
        raise CodecError("malformed", f"control command must be one of {sorted(CONTROL_COMMANDS)}")
    return body


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    field(body, "tick", int)
    field(body, "version", int)
    _names(body, "participants", "answer")
    return body


def _stream(body: dict[str, Any]) -> dict[str, Any]:
    """A stream batch's body; named labels become a unicode `y`."""
    field(body, "client", str)
    field(body, "task", int)
    field(body, "index", int)
    field(body, "end_of_task", bool)
    x, y = body.get("x"), body.get("y")
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise CodecError("malformed", "stream batch needs tensors x and y")
    if y.ndim != 1 or x.ndim < 1 or len(x) != len(y) or y.dtype.kind not in "iu":
        raise CodecError("shape", f"stream batch x {x.shape} / y {y.shape} {y.dtype} mismatch")
    if "names" in body:
        body["y"] = _stream_names(body.pop("names"), y)
    return body


@dataclass(frozen=True)
class Kind:
    """One message kind."""

    name: str
    form: str
    """update | tick | global (typed messages), map (a `Message`) or chunk."""
    topic: str
    """The topic family it travels on, under `<root>/<fleet>/` (`transport.topics`)."""
    sender: str
    help: str
    check: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """The body as decoded (`codec.decode` runs it on a map body); CodecError for one the
    kind cannot carry."""


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("update", "update", "update", "device", "a device's model update"),
    Kind("tick", "tick", "update", "device", "lock-step: a device's report without an update"),
    Kind("chunk", "chunk", "update", "device",
         "a piece of a payload larger than one MQTT message"),
    Kind("global", "global", "global", "aggregator", "a new global model (whole or a delta)"),
    Kind("answer", "map", "tick", "aggregator", "lock-step: the reply to a tick", _answer),
    Kind("config", "map", "config", "aggregator",
         "the fleet's retained configuration (what devices check before they join)"),
    Kind("status", "map", "status", "device, aggregator, worker",
         "a retained status (last will: offline)"),
    Kind("control", "map", "control", "operator", "pause, resume or stop", _control),
    Kind("stream", "map", "stream", "replayer", "a mini-batch of a replayed stream", _stream),
    Kind("partial", "map", "partial", "worker", "a worker's partial aggregate"),
    Kind("claim", "map", "partial", "worker", "a worker's claim of its next partial's clients"),
    Kind("grant", "map", "grant", "root", "the root's answer to a claim"),
)}

MAP_KINDS = frozenset(k.name for k in KINDS.values() if k.form == "map")
"""Kinds the codec carries as `Message`s."""


def kinds_on(topic: str) -> frozenset[str]:
    """The kinds a receiver decodes on topic family `topic` (chunks are reassembled first)."""
    return frozenset(k.name for k in KINDS.values() if k.topic == topic and k.form != "chunk")
