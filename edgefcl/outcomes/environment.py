"""Where and with what a run ran: versions, git commit, host, start time (for results.json)."""

from __future__ import annotations

import datetime
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any


def git_commit(path: Path | None = None) -> str | None:
    """The commit of the git checkout holding `path` (default: this package), with '-dirty'
    when it has local changes; None outside a checkout or without git."""
    where = path or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """edgefcl, torch, python and numpy versions, git commit (or None), host and start time
    (UTC, ISO 8601)."""
    import numpy
    import torch

    from edgefcl.version import __version__

    return {"edgefcl": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "numpy": numpy.__version__,
            "git_commit": git_commit(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
