"""What the fault tests and benches do to the local stack (tests/serve, tests/train, bench/bench_faults.py): lose a
worker node as a machine is lost, crash the head's GCS. `stack.lifecycle.up` brings either back, as KubeRay
replaces a pod."""

from __future__ import annotations

import os
import signal
import time

from stack import parts as stack_parts
from stack.processes import kill_session_and_wait, pid_alive, process_name, session_members
from stack.ray_node import worker_node_name
from stack.lifecycle import port_busy, read_state
from stack.config import StackConfig


def kill_node(cfg: StackConfig, i: int) -> int:
    """Lose worker node i as a machine is lost: SIGKILL its raylet and every process it runs (workers, agents,
    engines) at once, nothing shut down cleanly. `stack.up(cfg, parts=["nodes"])` brings a fresh node i back, as
    KubeRay replaces a lost worker pod. Returns how many processes were killed."""
    pid = read_state(cfg.state)["pids"].get(worker_node_name(i))
    if pid is None or not pid_alive(pid):
        raise RuntimeError(f"worker node {i} is not running (stack.json in {cfg.state})")
    return kill_session_and_wait(pid)


def kill_gcs(cfg: StackConfig) -> int:
    """SIGKILL the head's GCS process, as a crash would. `ray start --block` then takes the rest of the head down,
    as the head container exits on KubeRay; returns once the head's processes are gone. With `gcs_redis`,
    `stack.up(cfg, parts=["ray"])` starts a head that comes back with the cluster's state (as KubeRay restarts the head
    pod), and worker nodes that waited for it rejoin. Returns the GCS's PID."""
    head = read_state(cfg.state)["pids"].get("ray-head")
    if head is None or not pid_alive(head):
        raise RuntimeError(f"the Ray head is not running (stack.json in {cfg.state})")
    gcs = [p for p in session_members(head) if process_name(p) == "gcs_server"]
    if not gcs:
        raise RuntimeError(f"no gcs_server process in the Ray head's session (pid {head})")
    os.kill(gcs[0], signal.SIGKILL)
    deadline = time.time() + 30
    while pid_alive(head) and time.time() < deadline:  # `ray start --block` notices within a second
        time.sleep(0.1)
    kill_session_and_wait(head)  # whatever it left behind
    # A head started again needs the same ports: return once nothing listens on them any more.
    while time.time() < deadline + 30 and any(port_busy(p) for p in stack_parts.ports(cfg)["ray"]):
        time.sleep(0.2)
    return gcs[0]
