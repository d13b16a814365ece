"""Test-only fault injector: kill one training worker at a chosen step, once.

Off unless RAYLINE_FAULT_AT_STEP is set (users never set it). With it set, the worker of rank
RAYLINE_FAULT_RANK (default: the last rank) calls `os._exit` right after that optimizer step, as a
crashed or OOM-killed process would, unless the marker file RAYLINE_FAULT_MARKER exists; it creates
the marker first, so the restarted worker group passes the same step without dying again.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV_VARS = ("RAYLINE_FAULT_AT_STEP", "RAYLINE_FAULT_RANK", "RAYLINE_FAULT_MARKER")


def maybe_kill_worker(step: int, rank: int, world_size: int) -> None:
    at = os.environ.get("RAYLINE_FAULT_AT_STEP")
    if not at or step != int(at):
        return
    target = int(os.environ.get("RAYLINE_FAULT_RANK", world_size - 1))
    marker = Path(os.environ.get("RAYLINE_FAULT_MARKER", "/tmp/rayline-fault-fired"))
    if rank != target or marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"killed rank {rank} after step {step}\n")
    print(f"[rayline fault injector] killing rank {rank} after step {step}", flush=True)
    os._exit(137)
