"""The processes the local stack starts and stops: whether one lives, what else runs in its session, and
which Ray session a `ray start` in a session belongs to (read from /proc), and killing a whole session at once."""

from __future__ import annotations

import os
import signal
import time
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


def process_name(pid: int) -> str:
    """The process's command name (/proc/<pid>/comm), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


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


def kill_session(sid: int, spare: Iterable[int] = ()) -> int:
    """SIGKILL every process in session `sid` but those in `spare`; returns how many were signalled."""
    killed = 0
    for pid in set(session_members(sid)) - set(spare):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def kill_session_and_wait(sid: int, timeout_s: float = 10.0) -> int:
    """Kill session `sid` all at once, as a machine is lost, and return once its processes are gone (so their
    ports are free again) or `timeout_s` passed. Returns how many were killed."""
    members = session_members(sid)
    killed = kill_session(sid)
    deadline = time.time() + timeout_s
    while any(pid_alive(p) for p in members) and time.time() < deadline:
        time.sleep(0.05)
    return killed
