"""The embedded stack on its own ports and state dir: up, up again, env, a real job, down."""

import os
import socket
import subprocess
import sys
import time

import pytest

from pipelines import prometheus, stack
from pipelines.config import from_dict

ROOT = stack.PROJECT_ROOT


@pytest.fixture()
def mini_cfg(tmp_path):
    return from_dict(stack.StackConfig, {
        "state_dir": str(tmp_path / "state"), "ray_port": 6399, "dashboard_port": 8285, "ray_client_port": 23021,
        "serve_port": 8020, "mlflow_port": 5020, "dashboard_agent_port": 52385, "min_worker_port": 25000,
        "max_worker_port": 25999, "prometheus_port": 9290, "metrics_export_port": 8195,
    })


def _cli(cfg, *args):
    return subprocess.run([sys.executable, "-m", "pipelines.stack", *args, "--state-dir", cfg.state_dir],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_up_twice_env_job_down(mini_cfg, tmp_path):
    overrides = [f"{k}={v}" for k, v in stack.to_dict(mini_cfg).items() if k != "state_dir"]
    first = _cli(mini_cfg, "up", *overrides)
    try:
        assert first.returncode == 0, first.stderr + first.stdout
        assert "ray-head" in first.stdout and "mlflow" in first.stdout and "prometheus" in first.stdout
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
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        job = subprocess.run([ray_cli, "job", "submit", "--working-dir", str(job_dir), "--", "python", "hello.py"],
                             capture_output=True, text=True, env=job_env, timeout=300)
        assert job.returncode == 0 and "CPUS" in job.stdout, job.stdout[-2000:] + job.stderr[-2000:]

        mlflow_code = "import mlflow; mlflow.set_experiment('stack-test'); print(mlflow.get_experiment_by_name('stack-test').name)"
        ml = subprocess.run([sys.executable, "-c", mlflow_code], capture_output=True, text=True, env=job_env, timeout=120)
        assert ml.stdout.strip().endswith("stack-test"), ml.stderr[-2000:]

        # Prometheus scrapes the Ray node (found through Ray's discovery file), MLflow and itself.
        deadline = time.time() + 60
        while {t["job"] for t in prometheus.targets(env["RAYLINE_PROMETHEUS_URL"]) if t["health"] == "up"} != {
                "ray", "mlflow", "prometheus"} and time.time() < deadline:
            time.sleep(1)
        up = {(t["job"], t["url"]) for t in prometheus.targets(env["RAYLINE_PROMETHEUS_URL"]) if t["health"] == "up"}
        assert ("ray", "http://127.0.0.1:8195/metrics") in up and ("mlflow", "http://127.0.0.1:5020/metrics") in up, up
        assert prometheus.query(env["RAYLINE_PROMETHEUS_URL"], 'ray_node_cpu_count{instance="127.0.0.1:8195"}')

        # Everything listens on loopback only.
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        for port in (6399, 8285, 5020, 9290, 8195):
            addrs = [ln.split()[3] for ln in listening.splitlines() if ln.split()[3].endswith(f":{port}")]
            assert addrs and all("127.0.0.1" in a for a in addrs), (port, addrs)
    finally:
        pids = stack._read_state(mini_cfg.state)["pids"]
        down = _cli(mini_cfg, "down")
    assert down.returncode == 0
    assert pids and not any(stack.pid_alive(p) for p in pids.values())
    assert (mini_cfg.state / "mlflow" / "mlflow.db").exists()  # data kept


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
        rules = prometheus.api("http://127.0.0.1:9290", "rules")["groups"]
        assert sum(len(g["rules"]) for g in rules) == len(prometheus.alert_rules())  # the alert rules are loaded
    finally:
        stopped = stack.down(mini_cfg)
    assert stopped == ["prometheus"]
