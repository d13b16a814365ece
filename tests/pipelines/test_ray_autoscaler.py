"""Ray's autoscaler on the local stack (pipelines/ray_autoscaler.py): an actor the head cannot place makes the
autoscaler launch a worker node; once the node is idle the autoscaler removes it. Real parts: the stack's Ray
head with autoscaler v2 and its fake multi-node provider, a driver in its own process, Ray's node table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipelines import stack
from pipelines.config import from_dict
from pipelines.ray_autoscaler import AUTOSCALED_LABEL, autoscaling_config
from pipelines.ray_node import NODE_LABEL

ROOT = stack.PROJECT_ROOT
IDLE_TIMEOUT_S = 10.0

DRIVER = """
import json, subprocess, time, ray
from pipelines.ray_cluster import init_ray
init_ray()
t0 = time.monotonic()
events = []
def alive():
    return {n["NodeID"]: n["Labels"].get("rayline.io/node") for n in ray.nodes() if n["Alive"]}
@ray.remote(num_cpus=1)
class Holder:
    def node(self):
        return ray.get_runtime_context().get_node_id()
first = Holder.remote()
head = ray.get(first.node.remote(), timeout=120)
second = Holder.remote()          # the head's one CPU is taken: this one waits for the autoscaler
node = ray.get(second.node.remote(), timeout=240)
events.append(("second actor placed", round(time.monotonic() - t0, 1)))
labels = alive()
import psutil   # this cluster's processes (every one names its GCS port) and what they listen on
ours = {p.pid for p in psutil.process_iter(["cmdline"]) if any("%(gcs_port)s" in a for a in p.info["cmdline"] or [])}
listening = [ln.split()[3] for ln in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
             if any(f"pid={p}," in ln for p in ours)]
ray.kill(second)
released = time.monotonic()
while node in alive() and time.monotonic() - released < %(limit)s:
    time.sleep(0.5)
events.append(("autoscaled node gone", round(time.monotonic() - t0, 1)))
print(json.dumps({"head": labels.get(head), "node": labels.get(node), "nodes_while_busy": sorted(labels.values()),
                  "listening": listening, "idle_for": round(time.monotonic() - released, 1), "gone": node not in alive(), "events": events}))
"""


def test_the_config_gives_the_autoscaler_one_labelled_worker_type():
    cfg = autoscaling_config(head_cpus=1, node_cpus=2, max_nodes=3, idle_timeout_s=30, gcs_address="127.0.0.1:6399")
    worker = cfg["available_node_types"]["rayline.worker"]
    assert worker == {"resources": {"CPU": 2}, "labels": {NODE_LABEL: AUTOSCALED_LABEL}, "node_config": {},
                      "min_workers": 0, "max_workers": 3}
    assert cfg["provider"]["module"].endswith("fake_multi_node.node_provider.FakeMultiNodeProvider")
    assert cfg["provider"]["gcs_address"] == "127.0.0.1:6399"
    assert cfg["idle_timeout_minutes"] == 0.5 and cfg["max_workers"] == 3


def test_a_waiting_actor_adds_a_node_that_goes_once_idle(tmp_path):
    cfg = from_dict(stack.StackConfig, {
        "state_dir": str(tmp_path / "state"), "ray_port": 6409, "dashboard_port": 8295, "ray_client_port": 23031,
        "dashboard_agent_port": 52395, "min_worker_port": 26000, "max_worker_port": 26999, "num_cpus": 1,
        "metrics_export_port": 8196, "prometheus": False,
        "autoscale_nodes": 1, "node_cpus": 1, "autoscale_idle_timeout_s": IDLE_TIMEOUT_S,
    })
    try:
        stack.up(cfg, parts=["ray"])
        env = {**os.environ, **stack.env_vars(cfg)}
        out = subprocess.run([sys.executable, "-c", DRIVER % {"limit": IDLE_TIMEOUT_S + 90, "gcs_port": cfg.ray_port}], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=420)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        got = json.loads([ln for ln in lines if ln.startswith("{")][-1])
        # Ray reports the autoscaler's decisions to the driver: `(autoscaler +3s) Adding 1 node(s) of type ...`.
        decisions = [ln for ln in lines if "(autoscaler" in ln]
        print(got, decisions)
        assert any("Adding 1 node(s) of type rayline.worker" in ln for ln in decisions), lines
        assert got["head"] == "head" and got["node"] == AUTOSCALED_LABEL, got
        assert got["nodes_while_busy"] == [AUTOSCALED_LABEL, "head"], got
        # The autoscaled node's servers, like the head's, listen on loopback only.
        assert got["listening"] and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in got["listening"]), got
        # Removed once idle, by the idle timeout (not before it), within a minute and a half of it.
        assert got["gone"] and IDLE_TIMEOUT_S - 1 <= got["idle_for"] <= IDLE_TIMEOUT_S + 90, got
    finally:
        pids = stack._read_state(cfg.state).get("pids", {})
        stack.down(cfg)
    assert not any(stack.pid_alive(p) for p in pids.values())
