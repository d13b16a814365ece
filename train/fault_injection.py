"""Test-only fault injector: kill one training worker, or its whole node, at chosen steps, once each.

Off unless RAYLINE_FAULT_AT_STEP is set (users never set it): a step, or steps separated by commas. With it
set, the worker of rank RAYLINE_FAULT_RANK (default: the last rank) calls `os._exit` right after such an
optimizer step, as a crashed or OOM-killed process would, unless the marker file RAYLINE_FAULT_MARKER already
records that step; it records the step first (one line per fault), so the restarted worker group, or the run
submitted again, passes the same step without dying again.
With RAYLINE_FAULT_KIND=node it first SIGKILLs every other process of its Ray node (the raylet's session:
raylet, agents, the other workers), as a lost machine, at that exact step. Only on a local stack worker node
(`rayline.io/node=worker-<i>`): never the head, whose session is the whole stack's Ray.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FAULT_ENV_VARS = ("RAYLINE_FAULT_AT_STEP", "RAYLINE_FAULT_RANK", "RAYLINE_FAULT_MARKER", "RAYLINE_FAULT_KIND")


def maybe_kill_worker(step: int, rank: int, world_size: int) -> None:
    at = os.environ.get("RAYLINE_FAULT_AT_STEP")
    if not at or step not in {int(s) for s in at.split(",")}:
        return
    target = int(os.environ.get("RAYLINE_FAULT_RANK", world_size - 1))
    marker = Path(os.environ.get("RAYLINE_FAULT_MARKER", "/tmp/rayline-fault-fired"))
    if rank != target or step in fired_steps(marker):
        return
    node = os.environ.get("RAYLINE_FAULT_KIND", "process") == "node"
    label = node_label() if node else ""
    if node and not label.startswith("worker-"):
        raise RuntimeError(f"RAYLINE_FAULT_KIND=node kills only a worker node of the local stack; rank {rank} runs on "
                           f"{label or 'an unlabelled node'}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    what = f"node {label} of rank {rank}" if node else f"rank {rank}"
    with marker.open("a") as f:
        f.write(f"killed {what} after step {step}\n")
    print(f"[rayline fault injector] killing {what} after step {step}", flush=True)
    if node:
        kill_own_session()
    os._exit(137)


def fired_steps(marker: Path) -> set[int]:
    """The steps the marker file records a fault after."""
    text = marker.read_text() if marker.exists() else ""
    return {int(m) for m in re.findall(r"after step (\d+)$", text, flags=re.M)}


def node_label() -> str:
    """This process's Ray node's `rayline.io/node` label ("" when it has none)."""
    import ray

    from pipelines.ray_node import NODE_LABEL

    value = ray.get_runtime_context().get_node_labels().get(NODE_LABEL, "")
    return value[0] if isinstance(value, list) and value else str(value or "")


def kill_own_session() -> None:
    """SIGKILL every other process of this process's session (a Ray node's raylet and everything it started)."""
    from pipelines.processes import kill_session

    kill_session(os.getsid(0), spare=[os.getpid()])
