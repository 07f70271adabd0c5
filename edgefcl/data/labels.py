"""Label names, the labels of a prototype-head run from the data through the wire to predict.

- Bounds: a name has 1-MAX_LABEL_CHARS printable characters (`valid_name`); a library or a
  stream batch holds at most MAX_LABELS distinct names (`check_names`).
- `label_ids`: the integer a device uses for a name inside its tensors (replay memory groups,
  class counts). It is a function of the name alone, so every device gives a name the same id
  without any class list: a canonical decimal name ("0", "17") keeps its number (numbered
  datasets keep the ids they always had) and any other name gets 2^62 + the first 62 bits of
  its sha256 (disjoint from the numbers; a collision among 1,024 names has probability
  about 1e-13, and is refused where it happens).
- `name_tasks`: a workload's tasks with label names instead of class numbers (the stream and
  the test sets of a prototype-head run carry names; torch-free, like the replayer).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from edgefcl.data.types import DataError, TaskData

MAX_LABELS = 1024
"""Distinct labels one library or one stream batch may hold."""
MAX_LABEL_CHARS = 64
"""Characters of one label name."""
HASHED = 1 << 62
"""Ids at and above this are digests of names that are not canonical decimals."""


def valid_name(n: object) -> bool:
    """Whether `n` is a label name: a string of 1-MAX_LABEL_CHARS printable characters. No NUL
    or other control character: numpy's string arrays, which names travel in, drop trailing
    NULs, so "cat\\0" would become "cat" after every check made on the string."""
    return isinstance(n, str) and 0 < len(n) <= MAX_LABEL_CHARS and n.isprintable()


def check_names(names: Sequence[object]) -> str | None:
    """Why `names` (distinct labels) are not valid label names, or None."""
    if len(names) > MAX_LABELS:
        return f"{len(names)} labels > limit {MAX_LABELS}"
    for n in names:
        if not valid_name(n):
            return (f"label {str(n)[:80]!r} is not a string of 1-{MAX_LABEL_CHARS} printable "
                    "characters")
    return None


def label_id(name: str) -> int:
    """The id of one label name (see the module doc)."""
    if name.isascii() and name.isdigit() and (name == "0" or name[0] != "0"):
        number = int(name)
        if number < HASHED:
            return number
    return HASHED + (int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 2)


def label_names(y: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(the distinct names of labels `y`, sorted, and each sample's position among them).
    String labels are names; integer labels are named by their decimal string."""
    y = np.asarray(y)
    if y.dtype.kind not in "iuU":
        raise DataError(f"labels must be names (strings) or integers, got dtype {y.dtype}")
    uniq, inverse = np.unique(y, return_inverse=True)
    return [str(v) for v in uniq.tolist()], inverse.reshape(-1)


def as_names(y: np.ndarray, labels: Sequence[str] | None) -> np.ndarray:
    """Class numbers `y` as a unicode array of names (`labels[c]`, or the number itself)."""
    y = np.asarray(y)
    if y.dtype.kind == "U":
        return y
    table = np.array(list(labels) if labels is not None else
                     [str(c) for c in range(int(y.max()) + 1 if len(y) else 0)], dtype=str)
    reason = check_names(sorted(set(table.tolist())))
    if reason is not None or len(set(table.tolist())) != len(table):
        raise DataError(f"the dataset's labels cannot be label names: "
                        f"{reason or 'two classes have the same name'}")
    return table[y] if len(y) else np.zeros(0, table.dtype)


def name_tasks(tasks: list[list[TaskData]], labels: Sequence[str] | None
               ) -> list[list[TaskData]]:
    """Every task with its train, validation and test labels as names."""
    return [[dataclasses.replace(t, y_train=as_names(t.y_train, labels),
                                 y_val=as_names(t.y_val, labels),
                                 y_test=as_names(t.y_test, labels)) for t in client]
            for client in tasks]
