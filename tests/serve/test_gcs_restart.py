"""The head's GCS killed under serving load, with GCS fault tolerance on a real Redis (issue 21, faults): the worker
nodes' replicas keep answering through their own proxies while the head is down, the head comes back with the
cluster's state (the same worker nodes and replicas, not a new cluster), and a rollout afterwards works.

A stack of its own (ports apart from the test stack's): Redis (`redis-server`), a Ray head whose GCS keeps its
tables there (`gcs_redis`), MLflow, and three 1-CPU worker nodes. The scenario is tests/serve/gcs_faults.py
`serve_gcs_restart` (bench/bench_faults.py runs it too). The figures are printed.
"""

from __future__ import annotations

import os

import pytest

from stack import gcs_store, lifecycle as stack
from core.config import from_dict
from tests.conftest import replica_ports
from tests.serve.gcs_faults import serve_gcs_restart

GCS_STACK = {
    "state_dir": ".rayline-test-gcs", "ray_port": 6397, "dashboard_port": 8287, "ray_client_port": 23031,
    "dashboard_agent_port": 52395, "min_worker_port": 26000, "max_worker_port": 26999, "serve_port": 8030,
    "mlflow_port": 5030, "metrics_export_port": 8197, "prometheus": False, "gcs_redis": True, "redis_port": 6392,
    "nodes": 3, "node_cpus": 1, "node_port_base": 28000, "ray_env": replica_ports("gcs"),
}


@pytest.fixture(scope="module")
def gcs_stack(tmp_path_factory):
    reason = gcs_store.available()
    if reason:
        pytest.skip(f"GCS fault tolerance needs Redis: {reason}")
    cfg = from_dict(stack.StackConfig, {**GCS_STACK, "state_dir": str(tmp_path_factory.mktemp("gcs-stack"))},
                    "tests/serve/test_gcs_restart.py")
    saved = dict(os.environ)
    try:
        stack.up(cfg)
        os.environ.update(stack.env_vars(cfg))
        yield cfg
    finally:
        os.environ.clear()
        os.environ.update(saved)
        stack.down(cfg, grace_s=2)  # a test stack: nothing to keep


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_gcs_comes_back_with_its_state_while_the_workers_serve(gcs_stack, tiny_model_dir):
    run = serve_gcs_restart(gcs_stack, tiny_model_dir, warm_s=4.0, outage_s=2.0, after_s=3.0)
    report = run.summary()
    print(f"GCS killed under load: {report}; replica events (s, replica, state): {run.events}")
    assert run.redis_keys > 0  # the GCS kept its tables in Redis
    # The head came back as the same cluster: the worker nodes kept their node ids, and the app's two replicas
    # are the ones that ran before (Serve's controller recovered them, nothing was redeployed).
    assert run.nodes_after["head"] != run.nodes_before["head"]
    assert {k: v for k, v in run.nodes_after.items() if k != "head"} == \
        {k: v for k, v in run.nodes_before.items() if k != "head"}, (run.nodes_before, run.nodes_after)
    assert run.serve_back_at is not None, run.events
    assert run.replicas_after == run.replicas_before, (run.replicas_before, run.replicas_after)
    # The worker nodes' replicas answered through their proxies while the head was down, and nothing failed.
    outage = run.during_outage()
    assert outage and all(r.ok for r in outage), report
    assert not run.failed, report
    # A rollout afterwards: version 2 answers through the proxies.
    assert run.rolled_out_at is not None, report
