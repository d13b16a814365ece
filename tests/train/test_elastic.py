"""An elastic run end to end on the test stack: `python -m pipelines.train` with `scaling.num_workers: [1, 2]` on two
1-CPU worker nodes, one of which is lost mid-run and comes back.

The run starts on 2 workers (pinned to the worker nodes by their custom resource: Ray Train counts an elastic group's
size by resources alone). Right after step 8 the last rank's whole node is SIGKILLed: the run must go on with 1 worker
from its checkpoint at step 6 (resharded by DCP, the same global batch as 2 micro-batches on one worker), without
waiting for a replacement. Once that worker has committed a checkpoint of its own, a fresh node joins under the same
resource, as KubeRay replaces a lost pod, and the run must grow back to 2 workers and finish there. A reference run
of the same config that never resized reads the same rows at every step (train/batches.py), so every loss the
resized run logged, at either size, must be the reference's at that step up to float summation order.
"""

from __future__ import annotations

import pytest

from tests.train.test_train_stage import Result
from tests.train.train_faults import elastic_node_loss, elastic_on_worker_nodes

pytestmark = pytest.mark.timeout(1800)
STEPS = 40
KILL_AFTER = 8
ELASTIC = elastic_on_worker_nodes(STEPS)
# A shrink waits for Ray to see the node gone and for a group of 1 to start; a grow for Ray's autoscaling coordinator
# to see the node back (it looks every 20 s), the next resize check (5 s here) and a group of 2 to start.
SHRINK_WITHIN_S = 120
GROW_WITHIN_S = 150
PAUSE_S = 2.0


@pytest.fixture(scope="module")
def reference(make_train_config, run_stage, worker_nodes):
    """The same elastic config on the same two worker nodes, never resized."""
    cfg = make_train_config(*ELASTIC)
    run = run_stage("train", cfg)
    assert run.returncode == 0 and run.result, str(run)
    return cfg, Result(run.result), run


@pytest.fixture(scope="module")
def resized(reference, make_train_config, worker_nodes, tmp_path_factory):
    cfg = make_train_config(*ELASTIC)
    loss = elastic_node_loss(worker_nodes, cfg, tmp_path_factory.mktemp("elastic"), KILL_AFTER, PAUSE_S)
    assert loss.run.returncode == 0 and loss.run.result, str(loss.run)
    return cfg, Result(loss.run.result), loss


def test_a_lost_node_shrinks_the_run_and_a_returned_one_grows_it_back(resized, history, record_property):
    cfg, result, loss = resized
    run = loss.run
    assert result.final_step == STEPS, str(run)
    resizes = loss.resizes()
    assert [(old, new) for old, new, _, _ in resizes] == [(2, 1), (1, 2)], str(run)
    shrunk_at, grown_at = resizes[0][2], resizes[1][2]
    assert shrunk_at == 6  # checkpoints every 3 steps: 6 was the last before the loss after step 8
    assert KILL_AFTER < grown_at < STEPS

    run_id = result.mlflow_run_id
    assert history.values(run_id, "resize/to_workers") == [(shrunk_at, 1.0), (grown_at, 2.0)]
    assert [v for _, v in history.values(run_id, "resize/from_workers")] == [2.0, 1.0]
    # The steps logged past the checkpoint a resize resumed from (MLflow gets steps once a second: at least 0).
    lost = dict(history.values(run_id, "resize/steps_lost"))
    assert 0 <= lost[shrunk_at] <= KILL_AFTER - shrunk_at and 0 <= lost[grown_at] <= 3, lost
    # The size every step ran at: 2 before the loss, 1 from the checkpoint at 6 on, 2 again from the grow to the end.
    workers = history.values(run_id, "workers")
    assert {s for s, w in workers if w == 1.0} >= set(range(shrunk_at + 1, KILL_AFTER + 2))
    assert all(w == 2.0 for s, w in workers if s <= shrunk_at)
    assert history.curve(run_id, "workers")[STEPS] == 2.0

    # Within bounded times: from the kill (and from the node's return) to the first step at the new size.
    summary = loss.summary(history)
    record_property("shrink_s", summary["shrink_s"])  # in the junit report
    record_property("grow_s", summary["grow_s"])
    assert 0 < summary["shrink_s"] < SHRINK_WITHIN_S and 0 < summary["grow_s"] < GROW_WITHIN_S, summary


def test_the_resized_run_trains_on_the_rows_and_reaches_the_model_of_one_that_never_resized(
        reference, resized, history):
    ref, run = reference[1], resized[1]
    ref_loss = history.curve(ref.mlflow_run_id)
    assert sorted(ref_loss) == list(range(1, STEPS + 1))
    assert set(history.curve(ref.mlflow_run_id, "workers").values()) == {2.0}  # the reference never resized
    # Every loss the resized run logged, at 2 workers, at 1 (the same global batch as 2 micro-batches) and at 2 again,
    # is the reference's at that step: the same rows, the same weights, only summed in another order.
    logged = history.values(run.mlflow_run_id, "loss")
    assert {s for s, _ in logged} == set(range(1, STEPS + 1))
    for step, value in logged:
        assert value == pytest.approx(ref_loss[step], rel=1e-4, abs=1e-5), (step, value, ref_loss[step])
    assert run.eval_loss == pytest.approx(ref.eval_loss, rel=1e-4)
    assert run.goodput < ref.goodput  # two restarts, redone steps and the slow group of 1 (fault_injector slow_below)
    assert run.eval_loss < run.first_eval_loss - 1.0
