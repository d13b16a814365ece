"""The embedded stack on its own ports and state dir: up, up again, env, a real job, down."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from stack import lifecycle as stack, processes, prometheus
from core import prometheus_query
from core.config import from_dict
from stack.ray_node import alive_nodes, worker_node_ports

ROOT = stack.PROJECT_ROOT
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture()
def mini_cfg(tmp_path):
    return from_dict(stack.StackConfig, {
        "state_dir": str(tmp_path / "state"), "ray_port": 6399, "dashboard_port": 8285, "ray_client_port": 23021,
        "serve_port": 8020, "mlflow_port": 5020, "dashboard_agent_port": 52385, "min_worker_port": 20500,
        "max_worker_port": 20999, "prometheus_port": 9290, "metrics_export_port": 8195,
    })


def _cli(cfg, *args):
    return subprocess.run([sys.executable, "-m", "pipelines.stack", *args, "--state-dir", cfg.state_dir],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_up_twice_env_job_nodes_down(mini_cfg, tmp_path):
    overrides = [f"{k}={v}" for k, v in stack.to_dict(mini_cfg).items() if k != "state_dir"]
    first = _cli(mini_cfg, "up", *overrides)
    try:
        assert first.returncode == 0, first.stderr + first.stdout
        assert "ray-head" in first.stdout and "mlflow" in first.stdout and "prometheus" in first.stdout
        # `up` returned once the head's raylet registered, not only once its dashboard answered.
        token = stack.ray_token(mini_cfg)
        assert [n["is_head_node"] for n in alive_nodes(mini_cfg.dashboard_port, token)] == [True]
        again = _cli(mini_cfg, "up")
        assert again.returncode == 0 and "already running" in again.stdout
        status = _cli(mini_cfg, "status")
        assert status.returncode == 0 and status.stdout.count("healthy") == 3, status.stdout

        env_out = _cli(mini_cfg, "env").stdout
        env = dict(line.removeprefix("export ").split("=", 1) for line in env_out.splitlines())
        assert env["RAY_ADDRESS"] == "http://127.0.0.1:8285" and env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5020"
        assert env["RAYLINE_PROMETHEUS_URL"] == "http://127.0.0.1:9290"
        job_env = {**os.environ, **env}
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "hello.py").write_text("import ray\nray.init()\nprint('CPUS', ray.cluster_resources()['CPU'])\n")
        job = subprocess.run([RAY_CLI, "job", "submit", "--working-dir", str(job_dir), "--", "python", "hello.py"],
                             capture_output=True, text=True, env=job_env, timeout=300)
        assert job.returncode == 0 and "CPUS" in job.stdout, job.stdout[-2000:] + job.stderr[-2000:]

        mlflow_code = "import mlflow; mlflow.set_experiment('stack-test'); print(mlflow.get_experiment_by_name('stack-test').name)"
        ml = subprocess.run([sys.executable, "-c", mlflow_code], capture_output=True, text=True, env=job_env, timeout=120)
        assert ml.stdout.strip().endswith("stack-test"), ml.stderr[-2000:]

        # Prometheus scrapes the Ray node (found through Ray's discovery file, which also lists the dashboard's
        # and autoscaler's own metrics ports, up before the node's agent), MLflow and itself.
        wanted = {("ray", "http://127.0.0.1:8195/metrics"), ("mlflow", "http://127.0.0.1:5020/metrics"),
                  ("prometheus", "http://127.0.0.1:9290/metrics")}
        deadline = time.time() + 90
        while True:
            up = {(t["job"], t["url"]) for t in prometheus_query.targets(env["RAYLINE_PROMETHEUS_URL"]) if t["health"] == "up"}
            if wanted <= up or time.time() > deadline:
                break
            time.sleep(1)
        assert wanted <= up, up
        assert prometheus_query.query(env["RAYLINE_PROMETHEUS_URL"], 'ray_node_cpu_count{instance="127.0.0.1:8195"}')

        # Everything listens on loopback only.
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        for port in (6399, 8285, 5020, 9290, 8195):
            addrs = [ln.split()[3] for ln in listening.splitlines() if ln.split()[3].endswith(f":{port}")]
            assert addrs and all("127.0.0.1" in a for a in addrs), (port, addrs)

        # `up --nodes 2` on the running stack: two more raylets on this machine, labelled, placed on by label,
        # scraped, stopped by `down`.
        first = _cli(mini_cfg, "up", "node_cpus=1", "--nodes", "2")
        assert first.returncode == 0, first.stderr + first.stdout
        assert re.search(r"stack up \(([^)]*)\)", first.stdout).group(1) == "ray-worker-1, ray-worker-2", first.stdout
        status = _cli(mini_cfg, "status")
        assert status.returncode == 0 and "nodes    healthy" in status.stdout, status.stdout
        env = {**os.environ, **stack.env_vars(stack.load_stack_config(mini_cfg.state_dir, []))}
        out = subprocess.run([sys.executable, "-c", NODE_PLACEMENT], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["nodes"] == [["127.0.0.1", "head", 2.0], ["127.0.0.1", "worker-1", 1.0], ["127.0.0.1", "worker-2", 1.0]]
        assert got["ran_on"] == {"worker-1": "worker-1", "worker-2": "worker-2", "head": "head"}

        # Each node's metrics agent is found through Ray's discovery file and scraped.
        node_metrics = {f"http://127.0.0.1:{worker_node_ports(mini_cfg, i)['metrics_export']}/metrics" for i in (1, 2)}
        deadline = time.time() + 60
        while not node_metrics <= (up := {t["url"] for t in prometheus_query.targets("http://127.0.0.1:9290")
                                          if t["job"] == "ray" and t["health"] == "up"}) and time.time() < deadline:
            time.sleep(1)
        assert node_metrics <= up, up

        # No process of the stack listens beyond loopback, the worker nodes' included.
        pids = stack.read_state(mini_cfg.state)["pids"].values()
        members = {p for sid in pids for p in processes.session_members(sid)}
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        ours = [ln.split()[3] for ln in listening if any(f"pid={p}," in ln for p in members)]
        assert ours and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in ours), ours

        # Stopping only the nodes returns once the head no longer counts them: the next job sizes itself from
        # what the cluster reports (a data job planned for 4 CPUs on the 2-CPU head waited forever).
        worker_pids = [p for n, p in stack.read_state(mini_cfg.state)["pids"].items() if n.startswith("ray-worker")]
        assert sorted(stack.down(stack.load_stack_config(mini_cfg.state_dir, []), parts=["nodes"])) == [
            "ray-worker-1", "ray-worker-2"]
        assert not any(stack.pid_alive(p) for p in worker_pids)
        assert set(stack.node_ids(mini_cfg)) == {"head"}
        assert stack.status(stack.load_stack_config(mini_cfg.state_dir, []))["ray"]["healthy"]
    finally:
        pids = stack.read_state(mini_cfg.state)["pids"]
        down = _cli(mini_cfg, "down")
    assert down.returncode == 0 and "ray-head" in down.stdout
    assert pids and not any(stack.pid_alive(p) for p in pids.values())
    assert (mini_cfg.state / "mlflow" / "mlflow.db").exists()  # data kept


def test_a_job_runs_on_the_stack_it_was_submitted_to_when_another_started_later(mini_cfg, tmp_path):
    """Ray's job supervisor gives a job's driver the cluster that `<temp dir>/ray_current_cluster` names, which the
    last `ray start` with that temp dir wrote. Each stack's head has a temp dir of its own (StackConfig.ray_temp_dir):
    a job submitted to a stack runs there, and a plain `ray.init()` joins it, though another stack started later."""
    import dataclasses

    later = dataclasses.replace(mini_cfg, state_dir=str(tmp_path / "later"), ray_port=6429, dashboard_port=8315,
                                ray_client_port=23051, dashboard_agent_port=52415, min_worker_port=22000,
                                max_worker_port=22999, metrics_export_port=8199, num_cpus=1)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "where.py").write_text("import ray\nray.init()\nprint('GCS', ray.get_runtime_context().gcs_address)\n")
    try:
        stack.up(mini_cfg, parts=["ray"])
        stack.up(later, parts=["ray"])
        assert mini_cfg.ray_temp_dir != later.ray_temp_dir
        job = subprocess.run([RAY_CLI, "job", "submit", "--working-dir", str(job_dir), "--", "python", "where.py"],
                             capture_output=True, text=True, timeout=300, env={**os.environ, **stack.env_vars(mini_cfg)})
        assert job.returncode == 0 and f"GCS 127.0.0.1:{mini_cfg.ray_port}" in job.stdout, job.stdout[-2000:]
    finally:
        stack.down(later, grace_s=2)
        stack.down(mini_cfg, grace_s=2)


def test_busy_port_is_named(mini_cfg):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 5020))
        s.listen()
        cfg = from_dict(stack.StackConfig, {**stack.to_dict(mini_cfg), "dashboard_port": 8285})
        with pytest.raises(RuntimeError, match="port 5020 on 127.0.0.1 is already in use"):
            stack.up(cfg)
    stack.down(cfg)


def test_up_starts_only_the_parts_asked_for(mini_cfg):
    try:
        result = stack.up(mini_cfg, parts=["mlflow"])
        assert result["started"] == ["mlflow"]
        st = stack.status(mini_cfg)
        assert st["mlflow"]["healthy"] and not st["ray"]["healthy"] and not st["ray"]["pids"], st
    finally:
        stopped = stack.down(mini_cfg)
    assert stopped == ["mlflow"]


def test_without_prometheus_installed_up_says_why(mini_cfg, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # a machine without the prometheus package
    try:
        result = stack.up(mini_cfg, parts=["prometheus"])
        assert result["started"] == []
        assert result["notes"] == ["prometheus not started: prometheus not found: apt-get install prometheus "
                                   "(or `make`, which installs it as root)"]
        assert "prometheus" not in stack.status(mini_cfg) and "RAYLINE_PROMETHEUS_URL" not in stack.env_vars(mini_cfg)
    finally:
        stack.down(mini_cfg)


def test_prometheus_part_alone_runs_and_reloads_nothing_twice(mini_cfg):
    try:
        first = stack.up(mini_cfg, parts=["prometheus"])
        assert first["started"] == ["prometheus"] and stack.status(mini_cfg)["prometheus"]["healthy"]
        assert stack.up(mini_cfg, parts=["prometheus"])["started"] == []
        config = (mini_cfg.state / "prometheus" / "prometheus.yml").read_text()
        assert "127.0.0.1:5020" in config and str(prometheus.RULES) in config
        rules = prometheus_query.api("http://127.0.0.1:9290", "rules")["groups"]
        assert sum(len(g["rules"]) for g in rules) == len(prometheus.alert_rules())  # the alert rules are loaded
    finally:
        stopped = stack.down(mini_cfg)
    assert stopped == ["prometheus"]


NODE_PLACEMENT = """
import json, ray
from core.ray_cluster import init_ray
init_ray()
labels = {n["NodeID"]: n["Labels"].get("rayline.io/node") for n in ray.nodes() if n["Alive"]}
@ray.remote(num_cpus=1)
def node():
    return ray.get_runtime_context().get_node_id()
ran_on = {want: labels[ray.get(node.options(label_selector={"rayline.io/node": want}).remote())]
          for want in ("worker-1", "worker-2", "head")}
print(json.dumps({"nodes": sorted((n["NodeManagerAddress"], n["Labels"].get("rayline.io/node"), n["Resources"]["CPU"])
                                  for n in ray.nodes() if n["Alive"]), "ran_on": ran_on}))
"""


@pytest.mark.parametrize("overrides, field", [({"nodes": -1}, "nodes"), ({"node_cpus": 0}, "node_cpus"),
                                              ({"nodes": 3, "node_port_base": 65300}, "node_port_base"),
                                              ({"nodes": 2, "node_port_base": 10000}, "overlap the head's worker ports"),
                                              ({"nodes": 2, "node_port_base": 29950},
                                               "node_port_base: ports 30050-30249 overlap 30000-31000, where Serve"),
                                              ({"min_worker_port": 39000, "max_worker_port": 40500},
                                               "min_worker_port: ports 39000-40500 overlap 40000-41000"),
                                              ({"ray_env": {"RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": 2}}, "ray_env")])
def test_bad_worker_node_settings_are_named(overrides, field):
    from core.config import ConfigError

    with pytest.raises(ConfigError, match=field):
        from_dict(stack.StackConfig, overrides, "stack.json")


def test_every_ray_process_gets_the_registry_and_the_extra_env(mini_cfg):
    """The cluster's own processes (a Serve app built from an unpinned config, a replica resolving an adapter's
    alias) reach the stack's MLflow, and `ray_env` reaches the head and every worker node."""
    import dataclasses

    from stack.parts import specs

    cfg = dataclasses.replace(mini_cfg, nodes=2, ray_env={"RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "2"})
    parts = specs(cfg)
    envs = [env for _, _, env in parts["ray"] + parts["nodes"]]
    assert len(envs) == 3
    for env in envs:
        assert env["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{cfg.mlflow_port}"
        assert env["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"] == "2"
