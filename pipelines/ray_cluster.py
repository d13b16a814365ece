"""Connecting a driver to Ray the same way on a laptop, in a Ray job and on a KubeRay pod."""

from __future__ import annotations

import os

import ray

from pipelines.registry import PROJECT_ROOT


def ray_address() -> str | None:
    """The GCS address to join: a job's own RAY_ADDRESS, else the local stack's RAYLINE_RAY_GCS, else auto."""
    addr = os.environ.get("RAY_ADDRESS", "")
    if addr and not addr.startswith("http"):
        return addr
    return os.environ.get("RAYLINE_RAY_GCS") or None


def init_ray(**kwargs) -> None:
    """`ray.init` once per process. Outside a Ray job, ship the project's code to workers via PYTHONPATH."""
    if ray.is_initialized():
        return
    addr = ray_address()
    env = dict(os.environ)
    # The Jobs API's RAY_ADDRESS is the dashboard's HTTP URL; ray.init wants the GCS, so drop it here.
    if env.get("RAY_ADDRESS", "").startswith("http"):
        os.environ.pop("RAY_ADDRESS")
    runtime_env = kwargs.pop("runtime_env", None) or {}
    if not os.environ.get("RAY_JOB_SUBMISSION_ID") and "working_dir" not in runtime_env:
        env_vars = {**runtime_env.get("env_vars", {}), "PYTHONPATH": str(PROJECT_ROOT)}
        runtime_env = {**runtime_env, "env_vars": env_vars}
    try:
        ray.init(address=addr or "auto", runtime_env=runtime_env, log_to_driver=True, **kwargs)
    finally:
        if env.get("RAY_ADDRESS"):
            os.environ["RAY_ADDRESS"] = env["RAY_ADDRESS"]


def cluster_cpus() -> float:
    """Logical CPUs in the cluster (for sizing pools so they never take all of them)."""
    return float(ray.cluster_resources().get("CPU", 1.0))
