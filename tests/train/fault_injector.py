"""Test-only fault injector, installed through the training step hook (train/step_hook.py): kill one training
worker, or its whole node, at chosen steps, once each.

`fault_env(at="5,8", marker=...)` is the environment a test gives a stage: with it, the worker of rank `rank`
(default: the last rank) calls `os._exit` right after each such optimizer step, as a crashed or OOM-killed process
would, unless the marker file already records that step; it records the step first (one line per fault), so the
restarted worker group, or the run submitted again, passes the same step without dying again.
With kind="node" it first SIGKILLs every other process of its Ray node (the raylet's session: raylet, agents, the
other workers), as a lost machine, at that exact step. With kind="notice" it kills nothing: it sends SIGTERM to its
node's `ray start --block` process (the session's leader), as Kubernetes does to a pod's main process when a spot
reclaim or a deletion gives the pod its grace period, then holds the step for `notice_wait_s` (the notice on its way
to every rank: Ray's drain, Ray Train's watcher poll) and lets training go on. Both only on a local stack worker node
(`rayline.io/node=worker-<i>`): never the head, whose session is the whole stack's Ray.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from train.step_hook import STEP_HOOK_ARGS_ENV, STEP_HOOK_ENV


def fault_env(at: str, marker: Path | str, kind: str = "process", rank: int | None = None,
              notice_wait_s: float | None = None, slow_below: int = 0, pause_s: float = 0.0) -> dict[str, str]:
    """The environment that installs this injector in a training stage's workers. With `slow_below`, every step of a
    worker group smaller than that also takes `pause_s` longer (slow nodes: a smaller group's phase outlasts the
    return of a lost node, whatever the machine's speed)."""
    args = {"at": at, "marker": str(marker), "kind": kind, **({"target_rank": rank} if rank is not None else {}),
            **({"notice_wait_s": notice_wait_s} if notice_wait_s is not None else {}),
            **({"slow_below": slow_below, "pause_s": pause_s} if slow_below else {})}
    return {STEP_HOOK_ENV: f"{__name__}:after_step", STEP_HOOK_ARGS_ENV: json.dumps(args)}


def after_step(step: int, rank: int, world_size: int, *, at: str, marker: str, kind: str = "process",
               target_rank: int | None = None, notice_wait_s: float = 4.0, slow_below: int = 0,
               pause_s: float = 0.0) -> None:
    if world_size < slow_below:
        time.sleep(pause_s)
    if not at or step not in {int(s) for s in at.split(",")}:
        return
    target = world_size - 1 if target_rank is None else target_rank
    marker_path = Path(marker)
    if rank != target or step in fired_steps(marker_path):
        return
    node = kind in ("node", "notice")
    label = node_label() if node else ""
    if node and not label.startswith("worker-"):
        raise RuntimeError(f"kind={kind} hits only a worker node of the local stack; rank {rank} runs on "
                           f"{label or 'an unlabelled node'}")
    marker_path.parent.mkdir(parents=True, exist_ok=True)
    what = f"node {label} of rank {rank}" if node else f"rank {rank}"
    verb = "gave notice to" if kind == "notice" else "killed"
    with marker_path.open("a") as f:
        f.write(f"{verb} {what} after step {step}\n")
    print(f"[rayline fault injector] {verb} {what} after step {step}", flush=True)
    if kind == "notice":
        os.kill(os.getsid(0), signal.SIGTERM)  # the node's `ray start --block`: a pod's main process
        time.sleep(notice_wait_s)
        return
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

    from core.node_labels import NODE_LABEL

    value = ray.get_runtime_context().get_node_labels().get(NODE_LABEL, "")
    return value[0] if isinstance(value, list) and value else str(value or "")


def kill_own_session() -> None:
    """SIGKILL every other process of this process's session (a Ray node's raylet and everything it started)."""
    from stack.processes import kill_session

    kill_session(os.getsid(0), spare=[os.getpid()])
