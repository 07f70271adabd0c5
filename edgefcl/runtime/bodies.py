"""What a device reads from the aggregator's `config`, `status` and tick `answer` bodies, type
checked before the device keeps them. The codec lets any msgpack value through in a body
(a tensor map decodes to a numpy array); a body with the wrong type where the device reads a
string, a number or a list would otherwise crash it later, outside its message guard (a forged
body needs a stolen credential and a broken ACL, but a device never crashes on input)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 1024


def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_ints(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 8 and all(is_int(x) for x in v)


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(_is_str(x) for x in v)


_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "config": {"incarnation": _is_str, "run": _is_str, "spec_hash": _is_str, "method": _is_str,
               "model": _is_str, "encoding": _is_str, "aggregation": _is_str,
               "wire_dtype": _is_str, "mode": _is_str, "burn_in": is_int, "jump": is_int,
               "min_clients": is_int, "clients": is_int, "n_classes": is_int,
               "sample_shape": _is_ints, "seed": is_int, "tasks": is_int, "batch_size": is_int,
               "tasks_passed": is_int, "gate_version": is_int,
               "pull_globals": lambda v: isinstance(v, bool)},
    "status": {"state": _is_str, "reason": _is_str, "time": is_number,
               "incarnation": _is_str},
    "answer": {"tick": is_int, "version": is_int, "participants": _is_names},
}
"""The fields a device reads, by body kind, and what each must be where present."""
REQUIRED = {"config": (), "status": ("state",), "answer": ("tick", "version", "participants")}


def body_fault(kind: str, body: Any) -> str | None:
    """Why a device must not keep `body` of a `kind` message from the aggregator (config,
    status or answer), or None; other kinds are not checked here."""
    fields = _FIELDS.get(kind)
    if fields is None:
        return None
    if not isinstance(body, dict):
        return f"a {kind} body must be a map"
    for key in REQUIRED[kind]:
        if key not in body:
            return f"a {kind} body needs '{key}'"
    for key, ok in fields.items():
        if key in body and not ok(body[key]):
            return f"{kind} field '{key}' has the wrong type"
    return None
