"""What the Serve integration tests deploy: the tiny model on the CPU engine, sized for the shared 2-core Ray head.

    serve_config_dict(app, prefix, model)   the serving YAML (serve/serve_config.py) of one test app
    register_fresh(name, [(path, tags)])    the model registered anew in the test stack's MLflow
"""

from __future__ import annotations

from pipelines import registry

# The app tests/serve/conftest.py deploys for the session (test_serve.py, test_llm_hooks.py).
SERVED_MODEL, SERVED_APP, SERVED_PREFIX = "rayline-serve-test", "rayline-test-serve", "/serve-test"
TEST_ENGINE = {
    "accelerator": "cpu", "max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "enforce_eager": True,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "kv_cache_memory_bytes": 64 * 2**20,
    "cpus_per_engine": 0.2,
    # vLLM pins every CPU engine's compute thread to core 0 by default; on a shared 2-core box that core is
    # the busiest, and during a rolling update both engines would sit on it. One unpinned thread instead.
    "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
}


def serve_config_dict(app: str, prefix: str, model: str) -> dict:
    """The serving YAML the integration tests deploy: the tiny model, fractional CPUs for the shared 2-core head."""
    return {"app_name": app, "route_prefix": prefix, "served_model_id": "rayline",
            "engine": {"model": f"models:/{model}@champion", **TEST_ENGINE},
            "ingress_cpus": 0.05, "graceful_shutdown_timeout_s": 10}


def register_fresh(name: str, checkpoints: list[tuple[str, dict]]) -> list[str]:
    """Register `name` anew (earlier sessions' versions removed) with one version per (path, tags); returns versions."""
    c = registry.client()
    try:
        c.delete_registered_model(name)
    except Exception:
        pass
    versions = []
    with registry.start_run("rayline-tests", f"register-{name}") as run:
        for path, tags in checkpoints:
            mv = registry.register_checkpoint(name, path, run_id=run.info.run_id, tags=tags)
            versions.append(str(mv.version))
    return versions
