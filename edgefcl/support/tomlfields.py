"""TOML tables onto dataclasses (ground floor: the standard library only): one checked field at
a time, the type taken from the field's default. Used by the run configuration (config.py) and
firmware_sim's device profiles."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any


def coerce_field(cls: type, key: str, value: Any, table: str, error: type[Exception],
                 prefix: str = "") -> Any:
    """`value` checked for field `key` of dataclass `cls`, typed like the field's default: a
    bool must be a bool, a float any number (made float), an int an integer, a str a string;
    other fields take the value as it is. Raises `error("{prefix}...")` naming `[table]`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"[{table}]" if table else "the top level"
    if key not in fields:
        near = difflib.get_close_matches(key, fields, n=1)
        hint = f"did you mean '{near[0]}'?" if near else f"known: {', '.join(fields)}"
        raise error(f"{prefix}unknown key '{key}' in {where}; {hint}")
    default = fields[key].default
    name = f"{where} {key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise error(f"{prefix}{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{prefix}{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise error(f"{prefix}{name} must be an integer, got {value!r}")
    if isinstance(default, str) and not isinstance(value, str):
        raise error(f"{prefix}{name} must be a string, got {value!r}")
    return value


def apply_table(target: Any, table: str, values: Any, error: type[Exception],
                prefix: str = "") -> None:
    """Set fields of the dataclass instance `target` from the TOML table `[table]`."""
    if not isinstance(values, dict):
        raise error(f"{prefix}[{table}] must be a table")
    for k, v in values.items():
        setattr(target, k, coerce_field(type(target), k, v, table, error, prefix))
