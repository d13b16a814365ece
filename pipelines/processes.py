"""The processes the local stack starts and stops: whether one lives, what else runs in its session, and
which Ray session a `ray start` in a session belongs to. Read from /proc; nothing is stopped here."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def session_members(sid: int) -> list[int]:
    """PIDs in the process session `sid` (each part runs in a session of its own, led by its PID)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def ray_session_dir(pids: Iterable[int]) -> str | None:
    """The session dir of the Ray node started by `ray start` in the process session `pid` (from its processes'
    `--session-dir=` arguments), or None while it is still starting."""
    for sid in pids:
        for pid in session_members(sid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for arg in args:
                for flag in (b"--session-dir=", b"--session_dir="):
                    if arg.startswith(flag):
                        return arg[len(flag):].decode()
    return None
