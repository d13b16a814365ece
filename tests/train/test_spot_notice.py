"""A termination notice saves work, end to end on the test stack: `python -m pipelines.train` on two worker nodes, one
of which gets SIGTERM mid-run (a spot reclaim, a KubeRay pod deleted with its grace period).

What Kubernetes signals is a pod's main process, `ray start --block`; the pod's other processes (raylet, the train
worker) hear nothing until the node is torn down. So the notice here is SIGTERM to the worker node's `ray start
--block` process (its session leader), sent by the fault injector from the rank on that node right after a step
(tests/train/fault_injector.py, kind=notice). These nodes drain for DRAIN_S seconds on SIGTERM, as the rendered worker
pods do for `checkpoint.notice_grace_s` (rayjobs/manifests.py DRAIN_TIMEOUT_ENV); the stack's own nodes stop at once.
Checkpoints are periodic every 3 steps; the notice comes after step 4, so the last checkpoint before the node goes is
the notice's, not the periodic one at 3, and the run must resume from it and finish.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from rayjobs.manifests import DRAIN_TIMEOUT_ENV
from stack import lifecycle as stack
from tests.train.test_train_stage import TOTAL_STEPS
from tests.train.train_faults import ON_WORKER_NODES, spot_notice
from train.checkpoint import checkpoint_name

pytestmark = pytest.mark.timeout(1200)
DRAIN_S = 20
NOTICE_AFTER = 4
# The notice reaches the ranks through Ray's drain and Ray Train's watcher (polled every second: train/trainer.py);
# the injector holds the step this long meanwhile, so the ranks see it at that step's boundary, or at worst the next.
NOTICE_WAIT_S = 4.0


@pytest.fixture(scope="module")
def draining_nodes(local_stack):
    """Two 1-CPU worker nodes (worker-1, worker-2), as `worker_nodes`, whose `ray start --block` drains for DRAIN_S
    seconds on SIGTERM before it stops the node."""
    cfg = dataclasses.replace(local_stack, nodes=2, node_cpus=1,
                              ray_env={**local_stack.ray_env, DRAIN_TIMEOUT_ENV: str(DRAIN_S)})
    stack.up(cfg, parts=["nodes"])
    try:
        yield cfg
    finally:
        stack.down(cfg, parts=["nodes"])


def test_a_termination_notice_checkpoints_the_step_it_came_at_and_the_run_resumes_from_there(
        draining_nodes, make_train_config, history, tmp_path):
    cfg = make_train_config(*ON_WORKER_NODES)  # checkpoints at 3, 6, 9, 12; evals at 4, 8, 12
    notice = spot_notice(draining_nodes, cfg, tmp_path, NOTICE_AFTER, NOTICE_WAIT_S, DRAIN_S)
    run = notice.run
    assert run.returncode == 0 and run.result, str(run)
    left_at = notice.times["node_left"] - notice.times["signalled"]
    assert DRAIN_S - NOTICE_WAIT_S - 2 < left_at < DRAIN_S + 15, left_at  # it drained: not stopped at once

    # One notice, one save (a worker's line may reach the driver's log more than once: every node's log monitor).
    saved = sorted(set(re.findall(r"termination notice for nodes .* at step (\d+): ([\d.]+) s left, a checkpoint "
                                  r"takes ~([\d.]+) s .*: saving now", run.stdout)))
    assert len(saved) == 1, str(run)
    step = notice.saved_step()
    # The step at the notice (or the one in progress when it arrived), not the last periodic checkpoint (3).
    assert NOTICE_AFTER <= step <= NOTICE_AFTER + 1, str(run)
    run_uri = f"{cfg.checkpoint.storage_path}/{cfg.run_name}"
    assert f"resumed from {run_uri}/{checkpoint_name(step)} at step {step}" in run.stdout, str(run)
    assert "not saving" not in run.stdout
    assert run.result["final_step"] == TOTAL_STEPS

    run_id = run.result["mlflow_run_id"]
    assert history.values(run_id, "notice/saved") == [(step, 1.0)]
    assert history.values(run_id, "resume/step") == [(step, float(step))]
    assert history.values(run_id, "resume/adam_step") == [(step, float(step))]
    # No step ran after the notice's checkpoint before the node went: the ranks waited; the resumed group did the rest.
    history.assert_resumed(run_id, [(step, step)], total=TOTAL_STEPS)
    assert notice.summary(history)["steps_lost"] == 0
    notice_save_s = history.values(run_id, "notice/save_s")[0][1]
    left_s = history.values(run_id, "notice/seconds_left")[0][1]
    assert 0 < notice_save_s < left_s <= DRAIN_S
    print(f"\nnotice at step {step}: {left_s:.1f} s of {DRAIN_S} s left when seen, the save took {notice_save_s:.2f} s "
          f"(estimate {saved[0][2]} s); the node left {left_at:.1f} s after SIGTERM")
