"""Test-only fault injector for the GRPO loop (posttrain/grpo/loop.py `run(..., before_update=...)`): SIGKILL one
rollout engine's and one policy rank's process once, before a chosen update, as a lost node would."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import ray


def kill_roles_before(update: int):
    """A `before_update` hook that kills the roles once, before update `update` (a marker file in the output)."""

    def hook(current: int, roles, output: Path) -> None:
        marker = output / "fault_fired"
        if current != update or marker.exists():
            return
        marker.write_text("1")
        for pid in ray.get([roles.pool.actors[0].pid.remote(), roles.policy[0].pid.remote()]):
            os.kill(pid, signal.SIGKILL)

    return hook
