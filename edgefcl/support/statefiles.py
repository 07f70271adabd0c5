"""Atomic on-disk state files (ground floor: numpy and the standard library only): write to a
temporary file, fsync, then rename over the old one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import ConfigError

Tensors = dict[str, np.ndarray]


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # the process's umask, read once (`os.umask` can only set it)


def atomic_write(path: Path, data: bytes, fsync: bool = True, shared: bool = False) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never a mix
    (temporary file + rename); with `fsync` the data and the rename survive a power cut. The
    file is its owner's alone (state), or with `shared` readable by all, like a plot (a
    run's results for collaborators on the machine)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if shared:
            with contextlib.suppress(OSError):  # (a file system without modes: as it comes)
                os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def load_json(path: Path) -> Any:
    """The JSON in `path`; ConfigError (one line, what to do) when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); a write cut short? delete it, or "
                          "run what wrote it again") from None


def save_tensors(path: Path, tensors: Tensors, shared: bool = False) -> None:
    buf = io.BytesIO()
    np.savez(buf, **tensors)
    atomic_write(path, buf.getvalue(), shared=shared)


def load_tensors(path: Path) -> Tensors:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def make_dir(path: Path, what: str = "--out") -> Path:
    """Create `path` (and its parents) or raise ConfigError saying why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what}: cannot create {path}: {e.strerror or e}") from None
    return path
