"""Connecting a driver to Ray the same way on a laptop, in a Ray job and on a KubeRay pod."""

from __future__ import annotations

import os

import ray

from core import usage
from core.registry import PROJECT_ROOT, ray_job_id


def ray_address() -> str | None:
    """The GCS address to join: a job's own RAY_ADDRESS, else the local stack's RAYLINE_RAY_GCS, else auto."""
    addr = os.environ.get("RAY_ADDRESS", "")
    if addr and not addr.startswith("http"):
        return addr
    return os.environ.get("RAYLINE_RAY_GCS") or None


def _keep_loopback(addr: str | None) -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported; a process that imported ray
    before the local stack's env was set would rewrite 127.0.0.1 to the machine's public IP, where the
    loopback-only stack does not listen, and hang in ray.init. Apply the env's intent now."""
    from ray._private import ray_constants

    host = (addr or "").rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost") and os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR) == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


def reload_auth_config() -> None:
    """Ray caches RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH the first time its config is read; a process that
    touched Ray before the stack's env was set would connect without the token and be refused. Re-read."""
    if os.environ.get("RAY_AUTH_MODE"):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def init_ray(**kwargs) -> None:
    """`ray.init` once per process. Outside a Ray job, ship the project's code to workers via PYTHONPATH."""
    if ray.is_initialized():
        return
    addr = ray_address()
    _keep_loopback(addr)
    reload_auth_config()
    env = dict(os.environ)
    # The Jobs API's RAY_ADDRESS is the dashboard's HTTP URL; ray.init wants the GCS, so drop it here.
    if env.get("RAY_ADDRESS", "").startswith("http"):
        os.environ.pop("RAY_ADDRESS")
    # Every worker process of this job reports what it used to the job's ledger (core/usage.py).
    runtime_env = {"worker_process_setup_hook": usage.HOOK, **(kwargs.pop("runtime_env", None) or {})}
    if not ray_job_id() and "working_dir" not in runtime_env:
        # This driver's MLflow role goes to its workers too (names of files, never the secrets in them).
        login = {k: os.environ[k] for k in ("RAYLINE_ROLE", "RAYLINE_CREDENTIALS_DIR", "RAYLINE_MLFLOW_CREDENTIALS")
                 if os.environ.get(k)}
        env_vars = {**runtime_env.get("env_vars", {}), "PYTHONPATH": str(PROJECT_ROOT), **login}
        runtime_env = {**runtime_env, "env_vars": env_vars}
    try:
        ray.init(address=addr or "auto", runtime_env=runtime_env, log_to_driver=True, **kwargs)
    finally:
        if env.get("RAY_ADDRESS"):
            os.environ["RAY_ADDRESS"] = env["RAY_ADDRESS"]


def cluster_cpus() -> float:
    """Logical CPUs in the cluster (for sizing pools so they never take all of them)."""
    return float(ray.cluster_resources().get("CPU", 1.0))


def node_free_cpus() -> float:
    """The most CPUs one task can get now: the largest free CPU count of any alive node. A task asking for more
    waits forever, even when the cluster as a whole has them (CPUs are spread over nodes, or held by a
    running app)."""
    return max(free_cpus_per_node(), default=0.0)


def free_cpus_per_node() -> list[float]:
    """Free CPUs of each alive node, largest first."""
    from ray._private import state

    return sorted((float(r.get("CPU", 0.0)) for r in state.available_resources_per_node().values()), reverse=True)


def read_parquet(paths, **kwargs) -> "ray.data.Dataset":
    """`ray.data.read_parquet` through Ray Data's task-based Parquet reader (`use_datasource_v2=False`).

    Ray 2.60's default reader lists files on a pool of `FooterReader` actors that it starts, and kills, on
    every execution: fresh worker processes each time, 5-8 s per read even of one small file on a 2-CPU
    cluster (measured on the test stack), and again every epoch for a split that is streamed. rayline reads
    a few Parquet files per split, which the task-based reader lists in the driver: 0.2-0.4 s per read once
    the job's workers run. Options are `ray.data.read_parquet`'s.
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    saved = context.use_datasource_v2
    context.use_datasource_v2 = False
    try:
        return ray.data.read_parquet(paths, **kwargs)
    finally:
        context.use_datasource_v2 = saved
