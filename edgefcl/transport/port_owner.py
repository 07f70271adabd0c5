"""Which program listens on a TCP port, for a clear error when `edgefcl broker` finds it taken.

Linux only, read from /proc (`/proc/net/tcp*` gives the listening socket's inode, a process's
`fd/` links name it); elsewhere, or when the owner runs as another user whose /proc entries are
closed to us, the answer is None and the caller says only that the port is taken.
"""

from __future__ import annotations

import os
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Inodes of the sockets listening on `port` (IPv4 and IPv6)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def port_owner(port: int, proc: Path = Path("/proc")) -> str | None:
    """`name (pid N)` of a process listening on `port`, or None when it cannot tell."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
            if any(os.readlink(entry / "fd" / fd) in targets for fd in fds):
                return f"{(entry / 'comm').read_text().strip()} (pid {entry.name})"
        except OSError:  # gone, or another user's
            continue
    return None
