"""Training under node faults on the local stack, each written once for the tests and bench/bench_faults.py:
`elastic_node_loss` (an elastic run loses a worker node and gets it back: tests/train/test_elastic.py) and
`spot_notice` (a worker node is given a termination notice: tests/train/test_spot_notice.py).

Both start `python -m pipelines.train` on the stack's two 1-CPU worker nodes, let the fault injector
(tests/train/fault_injector.py) hit the last rank's node right after a chosen step, bring a fresh node back as KubeRay
replaces a pod, and return the finished run with the times that matter, measured against MLflow's step timestamps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import storage
from core.node_labels import NODE_LABEL
from stack import faults as stack_faults, lifecycle as stack
from stack.processes import kill_session_and_wait, pid_alive
from stack.ray_node import WORKER_NODE_RESOURCE, worker_node_name
from tests.train.fault_injector import fault_env
from tests.train.stages import History, StageRun, start_stage
from train.checkpoint import newest_trainer_state


# A fixed-size run's two workers, one on each of the two 1-CPU worker nodes, so that losing a node loses a rank.
ON_WORKER_NODES = (f"scaling.node_labels={{{NODE_LABEL}: 'in(worker-1,worker-2)'}}", "scaling.resources_per_worker={CPU: 1}")


def elastic_on_worker_nodes(steps: int) -> tuple[str, ...]:
    """An elastic [1, 2] run of `steps` steps on the worker nodes, pinned by their resource (Ray Train counts an
    elastic group's size by resources alone), checking for room to grow every 5 s."""
    return ("scaling.num_workers=[1, 2]", f"scaling.resources_per_worker={{CPU: 1, {WORKER_NODE_RESOURCE}: 1}}",
            "scaling.resize_check_s=5", f"train.max_steps={steps}", "train.eval_every_steps=8")


def _wait_for_marker(started, marker: Path) -> float:
    deadline = time.monotonic() + 900
    while not marker.exists() and started.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), str(started.finish(timeout=5))
    return time.time()


def _first_step_at(history: History, run_id: str, size: float, after_step: int) -> float:
    """When (epoch seconds) the run logged its first step past `after_step` on `size` workers."""
    return min(m.timestamp for m in history.client.get_metric_history(run_id, "workers")
               if m.value == size and m.step > after_step) / 1000


@dataclass
class ElasticLoss:
    run: StageRun
    kill_after: int
    times: dict[str, float] = field(default_factory=dict)
    """Epoch seconds: `killed`, `node_back`."""

    def resizes(self) -> list[tuple[int, int, int, int]]:
        """(old size, new size, step resumed from, steps to redo) of each resize, from the run's log."""
        found = re.findall(r"resized from (\d+) to (\d+) workers at step (\d+) \((\d+) steps to redo\)", self.run.stdout)
        return list(dict.fromkeys(tuple(int(x) for x in r) for r in found))  # each rank-0 line once

    def summary(self, history: History) -> dict:
        run_id = self.run.result["mlflow_run_id"]
        (_, _, shrunk_at, _), (_, _, grown_at, grow_redo) = self.resizes()[:2]
        return {"exit": self.run.returncode, "final_step": self.run.result["final_step"],
                "shrunk_at": shrunk_at, "shrink_steps_lost": self.kill_after - shrunk_at,
                "shrink_s": round(_first_step_at(history, run_id, 1.0, shrunk_at) - self.times["killed"], 1),
                "grown_at": grown_at, "grow_steps_lost": grow_redo,
                "grow_s": round(_first_step_at(history, run_id, 2.0, grown_at) - self.times["node_back"], 1)}


def elastic_node_loss(nodes, cfg, workdir: Path, kill_after: int = 8, pause_s: float = 2.0) -> ElasticLoss:
    """Run `cfg` (an elastic [1, 2] run on the worker nodes of `nodes`); right after step `kill_after` the last rank's
    node is SIGKILLed whole. Once the group of 1 has committed a checkpoint of its own, a fresh node joins and the run
    must grow back. Steps of a group of 1 take `pause_s` longer (tests/train/fault_injector.py `slow_below`), so that
    it is still going when the grow can come, whatever the machine's speed."""
    marker = workdir / f"killed-{cfg.run_name}"
    run_uri = storage.join(cfg.checkpoint.storage_path, cfg.run_name)
    started = start_stage("train", cfg, workdir, env=fault_env(at=str(kill_after), marker=marker, kind="node",
                                                               slow_below=2, pause_s=pause_s))
    loss = ElasticLoss(run=None, kill_after=kill_after)
    loss.times["killed"] = _wait_for_marker(started, marker)
    lost = int(re.search(r"node worker-(\d+)", marker.read_text()).group(1))
    if stack.pid_alive(stack.read_state(nodes.state)["pids"].get(worker_node_name(lost), -1)):
        stack_faults.kill_node(nodes, lost)  # the whole node, from outside too, before its replacement starts
    while started.proc.poll() is None and time.time() < loss.times["killed"] + 600:
        saved = newest_trainer_state(run_uri)
        if saved and saved[1].world_size == 1 and saved[1].step > kill_after:
            break
        time.sleep(0.5)
    stack.up(nodes, parts=["nodes"])
    loss.times["node_back"] = time.time()
    loss.run = started.finish(timeout=900)
    return loss


@dataclass
class SpotNotice:
    run: StageRun
    times: dict[str, float] = field(default_factory=dict)
    """Epoch seconds: `signalled` (SIGTERM to the node's `ray start`), `node_left`, `node_back`."""

    def saved_step(self) -> int:
        """The step the notice's checkpoint was taken at (the run's log; one notice, one save)."""
        saved = sorted(set(re.findall(r"termination notice for nodes .* at step (\d+): .*: saving now", self.run.stdout)))
        assert len(saved) == 1, str(self.run)
        return int(saved[0])

    def summary(self, history: History) -> dict:
        run_id = self.run.result["mlflow_run_id"]
        step = self.saved_step()
        taken = [m.step for m in history.client.get_metric_history(run_id, "loss") if m.timestamp / 1000 <
                 self.times["node_left"]]
        resumed = [m.timestamp / 1000 for m in history.client.get_metric_history(run_id, "loss")
                   if m.step > step and m.timestamp / 1000 > self.times["node_left"]]
        return {"exit": self.run.returncode, "final_step": self.run.result["final_step"], "saved_at": step,
                "steps_lost": max(taken, default=step) - step,
                "node_left_s": round(self.times["node_left"] - self.times["signalled"], 1),
                "recovered_s": round(min(resumed) - self.times["signalled"], 1)}


def spot_notice(nodes, cfg, workdir: Path, notice_after: int, notice_wait_s: float, drain_s: float) -> SpotNotice:
    """Run `cfg` on the worker nodes of `nodes` (which drain `drain_s` seconds on SIGTERM); right after step
    `notice_after` the last rank's node gets SIGTERM to its `ray start --block`, as a pod deleted with its grace
    period; once the node has drained and stopped, whatever it left is killed and a fresh node joins."""
    marker = workdir / f"notice-{cfg.run_name}"
    started = start_stage("train", cfg, workdir, env=fault_env(at=str(notice_after), marker=marker, kind="notice",
                                                               notice_wait_s=notice_wait_s))
    notice = SpotNotice(run=None)
    notice.times["signalled"] = _wait_for_marker(started, marker)
    node = int(re.search(r"node worker-(\d+)", marker.read_text()).group(1))
    pid = stack.read_state(nodes.state)["pids"][worker_node_name(node)]
    while pid_alive(pid) and time.time() < notice.times["signalled"] + drain_s + 30:
        time.sleep(0.2)  # the node drains, then its `ray start` stops it: the pod is gone
    notice.times["node_left"] = time.time()
    kill_session_and_wait(pid)  # whatever it left behind, as the kubelet's SIGKILL would
    stack.up(nodes, parts=["nodes"])  # KubeRay's replacement pod, under the same label
    notice.times["node_back"] = time.time()
    notice.run = started.finish(timeout=600)
    return notice
