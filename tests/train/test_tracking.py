"""Rank 0's metric logger (train/tracking.py): steps are queued and sent in batches to the real MLflow server."""

from __future__ import annotations

import mlflow

from core import registry
from train.tracking import MetricLogger


class Clock:
    """The only fake: time, advanced by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_sent_in_batches_and_all_by_a_flush(local_stack):
    client = registry.client()
    run_id = client.create_run(mlflow.set_experiment("rayline-test-tracking").experiment_id).info.run_id
    clock = Clock()
    logger = MetricLogger(run_id, flush_every_s=1.0, clock=clock)
    steps = lambda: [m.step for m in client.get_metric_history(run_id, "loss")]  # noqa: E731

    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "lr": 0.1, "mfu": None})
    assert steps() == []  # queued: no call per step
    clock.now = 1.0
    logger.log(4, {"loss": 0.25, "lr": 0.1})
    assert steps() == [1, 2, 3, 4]  # the second passed: one call took the queue
    logger.log(5, {"loss": 0.2})
    logger.flush()
    assert steps() == [1, 2, 3, 4, 5]
    assert [m.value for m in client.get_metric_history(run_id, "lr")] == [0.1] * 4
    assert "mfu" not in client.get_run(run_id).data.metrics  # None is not a value


def test_a_queue_over_mlflows_batch_limit_goes_in_several_calls(local_stack):
    client = registry.client()
    run_id = client.create_run(mlflow.set_experiment("rayline-test-tracking").experiment_id).info.run_id
    logger = MetricLogger(run_id, flush_every_s=3600.0, clock=Clock())
    for step in range(600):  # 1,200 metrics: sent when the queue reaches 1,000, the rest by flush
        logger.log(step, {"loss": float(step), "lr": 0.5})
    assert len(client.get_metric_history(run_id, "loss")) == 500
    logger.flush()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(600))
