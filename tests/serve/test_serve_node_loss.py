"""Losing the node of one engine replica under load (issue 21, faults): Serve replaces the replica, the other one
keeps answering, and only requests sent to the lost one (in flight when its node went, or routed to it before
Serve marked it down) may fail.

Two 1-CPU worker nodes join the test stack's head (tests/conftest.py `worker_nodes`); the app is pinned to them
with `node_labels`, one replica per node. Under a bounded loopback load worker-1 is SIGKILLed whole (raylet,
workers, engine), as a lost machine; a fresh worker-1 then joins, as KubeRay replaces a lost pod
(tests/serve/serving.py `serve_node_loss`, which bench/bench_faults.py runs too). Real parts:
`python -m pipelines.serve`, vLLM engines on CPU, Ray's GCS noticing the node is gone, Serve's controller
replacing the replica, the `openai` client over HTTP. The figures are printed.
"""

from __future__ import annotations

import pytest

from tests.serve.serving import serve_node_loss

STREAMS = 6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_replica_node_is_replaced_while_the_other_replica_serves(worker_nodes, tiny_model_dir):
    loss = serve_node_loss(worker_nodes, tiny_model_dir, streams=STREAMS)
    report = loss.summary()
    print(f"node loss under load: {report}; replica events (s, replica, state): {loss.events}")
    before, after = loss.nodes_before, loss.nodes_after
    assert sorted(loss.placed.values()) == sorted([before["worker-1"], before["worker-2"]]), (loss.placed, before)
    assert loss.lost_replica, loss.placed
    assert loss.recovered_at is not None, f"no replacement replica: {loss.events}"
    # The replacement runs on the new worker-1, not on the lost node and not doubled up on worker-2.
    assert after["worker-1"] != before["worker-1"], after
    assert sorted(loss.replaced.values()) == sorted([after["worker-1"], before["worker-2"]]), (loss.replaced, after)
    # Only requests sent to the lost replica may fail: those in flight when its node went, and those Serve's
    # router still sent it before the controller marked it down (Ray's node health checks take seconds).
    assert loss.noticed_at is not None, loss.events
    assert all(r.start < loss.noticed_at for r in loss.failed), report
    # The surviving replica kept answering while the lost one was replaced, and the pair answers after.
    assert any(r.ok and loss.killed_at < r.end < loss.recovered_at for r in loss.requests), report
    after_recovery = [r for r in loss.requests if r.start > loss.recovered_at]
    assert after_recovery and all(r.ok for r in after_recovery), report
