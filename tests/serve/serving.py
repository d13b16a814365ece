"""What the Serve integration tests deploy: the tiny model on the CPU engine, sized for the shared 2-core Ray head.

    serve_config_dict(app, prefix, model)   the serving YAML (serve/online/serve_config.py) of one test app, with its API keys
    serving_keys()                          the test stack's API keys (client, admin, and one with a small rate)
    register_fresh(name, [(path, tags)])    the model registered anew in the test stack's MLflow
    deploy(serve_cfg)                       `python -m pipelines.serve` with that YAML, as a user deploys
    on_worker_nodes(serve_cfg)              the app's two replicas pinned to worker nodes 1 and 2

The loads the tests put on the apps are in tests/serve/load.py; the node-loss scenario in tests/serve/serve_faults.py.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from core import api_keys, registry
from core.secret_files import ensure_secret, read_secret
from serve.batch.tracking import record_figures
from tests.conftest import TEST_STACK

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


KEYS_STATE_DIR = registry.PROJECT_ROOT / TEST_STACK["state_dir"]
"""The test stack's state dir (tests/conftest.py TEST_STACK; test_api_keys.py checks they agree)."""
LIMITED = {"requests_per_minute": 3, "max_concurrent": 64}  # test_api_keys.py's burst runs out of it at once


@dataclass(frozen=True)
class ServingKeys:
    files: api_keys.StackKeys
    client: str
    admin: str
    limited: str


@functools.cache
def serving_keys() -> ServingKeys:
    """The test stack's API keys, made (once, kept) in its state dir as `stack up` makes a stack's, plus a client key
    with a small rate limit for test_api_keys.py."""
    limited = ensure_secret(api_keys.stack_keys(KEYS_STATE_DIR).folder / "limited_key")
    files = api_keys.create_stack_keys(KEYS_STATE_DIR, [api_keys.ApiKey.of("limited", limited, **LIMITED)])
    return ServingKeys(files, read_secret(files.client_key_file), read_secret(files.admin_key_file), limited)


def serve_config_dict(app: str, prefix: str, model: str) -> dict:
    """The serving YAML the integration tests deploy: the tiny model, fractional CPUs for the shared 2-core head, and
    the test stack's keys (by config, which the Ray processes' RAYLINE_API_KEYS_FILE would otherwise give)."""
    keys = serving_keys().files
    return {"app_name": app, "route_prefix": prefix, "served_model_id": "rayline",
            "engine": {"model": f"models:/{model}@champion", **TEST_ENGINE},
            "ingress_cpus": 0.05, "graceful_shutdown_timeout_s": 10,
            "auth": {"keys_file": str(keys.keys_file), "admin_key_file": str(keys.admin_key_file)}}


def http_json(url: str, body: dict | bytes | None = None, api_key: str | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or a JSON POST, error statuses included; sent with `api_key` (None: the
    test client key; "": none) and `headers`."""
    from serve.promotion.verify import key_header

    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    key = serving_keys().client if api_key is None else api_key
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **key_header(key),
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def free_port() -> int:
    """A TCP port free on loopback now (for a test's own listener)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_client(base_url: str, api_key: str | None = None):
    """The `openai` client the serving tests use: no retries (a failure must show), 120 s per request; `api_key` None:
    the test client key."""
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key or serving_keys().client, max_retries=0, timeout=120)


def register_fresh(name: str, checkpoints: list[tuple[str, dict]]) -> list[str]:
    """Register `name` anew (earlier sessions' versions removed) with one version per (path, tags); returns versions.
    `eval.<metric>` entries in tags become an eval run of that version's bytes too (serve/batch/tracking.py
    record_figures), as a batch eval job would log, so the rollout's gate sees them."""
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
    for version, (_, tags) in zip(versions, checkpoints):
        figures = {k: v for k, v in tags.items() if k.startswith("eval.")}
        if figures:  # what the gate reads: an eval run over the version's bytes, not the display tags
            record_figures(name, version, figures)
    return versions


def on_worker_nodes(serve_cfg: dict, nodes: int = 2) -> dict:
    """A test app's serving YAML with its two engine replicas pinned to worker nodes 1..`nodes` (1-CPU nodes: one
    replica each; a third node leaves room for a rolling update, whose new replicas start before old ones stop)."""
    from core.node_labels import NODE_LABEL

    serve_cfg["engine"]["cpus_per_engine"] = 1.0  # one replica fills a 1-CPU worker node
    workers = ",".join(f"worker-{i}" for i in range(1, nodes + 1))
    serve_cfg.update(autoscaling={"min_replicas": 2, "max_replicas": 2}, node_labels={NODE_LABEL: f"in({workers})"})
    return serve_cfg


def deploy(serve_cfg: dict, env: dict[str, str] | None = None) -> None:
    """`python -m pipelines.serve --config <serve_cfg as YAML>`, as a user deploys; raises with its output if it fails."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "serve.yaml"
        cfg_file.write_text(yaml.safe_dump(serve_cfg))
        out = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(cfg_file)], capture_output=True,
                             text=True, timeout=900, cwd=registry.PROJECT_ROOT, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"deploy failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")


def node_ids_by_label(cfg) -> dict[str, str]:
    """`rayline.io/node` label -> node id of the stack's alive nodes."""
    from stack import lifecycle as stack

    return {label: node for label, ids in stack.node_ids(cfg).items() for node in ids}
