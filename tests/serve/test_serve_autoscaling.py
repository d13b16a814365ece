"""Autoscaling, layers 1 and 2 together (issue 21): a bounded loopback load queues requests, Serve wants a second
engine replica (serve/online/serve_config.py AutoscalingConfig, on `target_ongoing_requests`), the head has no room for it,
so Ray's autoscaler (stack/ray_autoscaler.py) launches a worker node, where the replica starts. Once the load
stops, the second replica goes after Serve's downscale delay, and the node, idle, goes after the autoscaler's idle
timeout. The test records when each replica and node appeared and left, and prints it.

Real parts: a stack of its own (a 1-CPU Ray head running autoscaler v2 with the fake multi-node provider, MLflow),
the app deployed with `python -m pipelines.serve`, vLLM engines on CPU, the `openai` client over HTTP, replica
states from the dashboard's Serve REST API, nodes from its node table.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import psutil
import pytest

from core import registry
from stack import lifecycle as stack
from core.config import from_dict
from stack.ray_autoscaler import AUTOSCALED_LABEL
from serve.promotion.deploy_target import LocalServe
from tests.conftest import replica_ports
from tests.serve.serving import deploy, register_fresh, serve_config_dict
from tests.serve.load import ChatLoad, ReplicaTimeline

APP, PREFIX, MODEL = "rayline-test-autoscale", "/autoscale-test", "rayline-autoscale-test"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 2.0, "downscale_delay_s": 8.0, "look_back_period_s": 4.0, "metrics_interval_s": 1.0}
IDLE_TIMEOUT_S = 10.0
STREAMS = 8
# A 1-CPU head holds the ingress (0.05 CPU) and one engine replica (0.9): a second replica needs a node.
AUTOSCALING_STACK = {
    "ray_port": 6409, "dashboard_port": 8295, "ray_client_port": 23041, "dashboard_agent_port": 52405,
    "min_worker_port": 29000, "max_worker_port": 29799, "node_port_base": 29800, "metrics_export_port": 8196, "mlflow_port": 5031,
    "serve_port": 8031, "prometheus": False, "num_cpus": 1,
    "autoscale_nodes": 1, "node_cpus": 1, "autoscale_idle_timeout_s": IDLE_TIMEOUT_S,
    # A node's Serve proxy drains for at least 30 s (Serve's default) once its replica left, and the node is not idle
    # until it is gone: 2 s here, so the idle timeout starts soon after the replica stopped.
    "ray_env": {"RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "2", **replica_ports("autoscaling")},
}


@pytest.fixture
def autoscaling_stack(tmp_path):
    cfg = from_dict(stack.StackConfig, {**AUTOSCALING_STACK, "state_dir": str(tmp_path / "state")},
                    "tests/serve/test_serve_autoscaling.py")
    saved = dict(os.environ)
    try:
        stack.up(cfg, parts=["ray", "mlflow"])
        os.environ.update(stack.env_vars(cfg))
        yield cfg
    finally:
        os.environ.clear()
        os.environ.update(saved)
        pids = stack.read_state(cfg.state).get("pids", {})
        stack.down(cfg, grace_s=2)  # a test stack: nothing to keep
        assert not any(stack.pid_alive(p) for p in pids.values())


def autoscaled_nodes(cfg) -> set[str] | None:
    """The ids of the autoscaler's alive nodes; None when the dashboard did not answer (no head listed)."""
    labels = stack.node_ids(cfg)
    return labels.get(AUTOSCALED_LABEL, set()) if "head" in labels else None


def listening_addresses(gcs_port: int) -> list[tuple[str, str]]:
    """Where this cluster's processes (each names its GCS's port) and their children (HAProxy) listen:
    (address, process name) pairs."""
    ours = {p for p in psutil.process_iter(["cmdline"]) if any(f":{gcs_port}" in a for a in p.info["cmdline"] or [])}
    for proc in list(ours):
        try:
            ours.update(proc.children(recursive=True))
        except psutil.Error:
            pass
    names = {}
    for proc in ours:
        try:
            names[proc.pid] = proc.name()
        except psutil.Error:  # exited since it was listed (a worker, a short-lived child): it listens nowhere now
            pass
    found = []
    for ln in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
        pids = {int(pid) for pid in re.findall(r"pid=(\d+),", ln)} & names.keys()
        if pids:
            found.append((ln.split()[3], names[min(pids)]))
    return found


def wait_for_listeners(gcs_port: int, haproxies: int, timeout_s: float) -> list[tuple[str, str]]:
    """listening_addresses once `haproxies` HAProxy listeners are up, or as they stand after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        listening = listening_addresses(gcs_port)
        if len({a for a, name in listening if name == "haproxy"}) >= haproxies or time.monotonic() > deadline:
            return listening
        time.sleep(1.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_queue_adds_a_replica_and_a_node_and_both_go_once_idle(autoscaling_stack, tiny_model_dir):
    cfg = autoscaling_stack
    (version,) = register_fresh(MODEL, [(str(tiny_model_dir), {})])
    registry.set_alias(MODEL, "champion", version)
    serve_cfg = serve_config_dict(APP, PREFIX, MODEL)
    serve_cfg["engine"]["cpus_per_engine"] = 0.9
    serve_cfg["autoscaling"] = AUTOSCALING
    target = LocalServe(APP)
    deploy(serve_cfg)
    load = ChatLoad(f"http://127.0.0.1:{cfg.serve_port}{PREFIX}/v1", STREAMS)
    with ReplicaTimeline(target, watch_nodes=lambda: autoscaled_nodes(cfg)) as timeline:
        assert timeline.wait_for(lambda t: t.running == 1, 120), timeline.events
        assert not timeline.node_events, timeline.node_events  # one replica fits the head
        first = set(timeline.running_ids())
        load_started = timeline.now()
        with load:
            scaled_up = timeline.wait_for(lambda t: t.running == 2, 300)
            placed = dict(timeline.nodes)
            # The node's HAProxy starts with Serve's proxy for that node, which can come a few seconds after the replica.
            listening = wait_for_listeners(cfg.ray_port, haproxies=2, timeout_s=60) if scaled_up else []
        load_ended = timeline.now()
        scaled_down = timeline.wait_for(lambda t: t.running == 1 and t.replicas == 1, AUTOSCALING["downscale_delay_s"] + 120)
        node_gone = timeline.wait_for(lambda t: t.node_events and t.node_events[-1][2] == "LEFT", IDLE_TIMEOUT_S + 120)
    counts, replicas, nodes = load.counts(), timeline.events, timeline.node_events
    print(f"load {load_started:.1f}-{load_ended:.1f} s, {counts}; replicas (s, replica, state): {replicas}; "
          f"autoscaled nodes (s, node, event): {nodes}")
    assert scaled_up, f"no second replica under {STREAMS} streams: {replicas} {nodes}"
    # Layer 2: the second replica runs on the node the autoscaler launched for it, while the load ran.
    (second,) = set(placed) - first
    joined = [e for e in nodes if e[2] == "JOINED"]
    assert len(joined) == 1 and placed[second] == joined[0][1], (placed, nodes)
    assert load_started < joined[0][0] < load_ended, nodes
    assert counts["failed"] == 0 and counts["ok"] > 0, counts
    # The autoscaled node's servers, like the head's, listen on loopback only: Ray's, HAProxy (Serve's ingress on each
    # node, the autoscaled node's on a port of its own) and the replicas' own HTTP servers behind it (Serve gives them
    # ports from 30000-31000). The one exception is not rayline's or Ray's: vLLM's engine starts a torch.distributed
    # store (TCPStore) for its one-process group, which PyTorch binds on every interface at a random port.
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:")
    beyond = [(a, name) for a, name in listening if not a.startswith(loopback)]
    replica_http = [a for a, name in listening if "ServeReplica" in name and 30000 <= int(a.rsplit(":", 1)[1]) <= 31000]
    assert listening and all("ServeReplica" in name and a.startswith("*:") for a, name in beyond), beyond
    assert len(replica_http) == 2 and all(a.startswith(loopback) for a in replica_http), listening
    assert len({a for a, name in listening if name == "haproxy"}) == 2, listening  # the head's and the node's
    # Layer 1 down: the second replica (not the head's) stopped once the load ended, not before the delay.
    assert scaled_down, f"the second replica did not go once the load stopped: {replicas}"
    assert set(timeline.running_ids()) == first, (first, replicas)
    stopped = [e for e in replicas if e[1] == second[-8:] and e[2] in ("STOPPING", "GONE")]
    assert stopped and stopped[0][0] - load_ended >= AUTOSCALING["downscale_delay_s"] - 1, replicas
    # Layer 2 down: the node, idle once its replica stopped, left after the idle timeout (not before it).
    assert node_gone, f"the autoscaled node stayed: {nodes}"
    idle_for = nodes[-1][0] - stopped[-1][0]
    assert IDLE_TIMEOUT_S - 1 <= idle_for <= IDLE_TIMEOUT_S + 120, (idle_for, replicas, nodes)
