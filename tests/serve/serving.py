"""What the Serve integration tests deploy: the tiny model on the CPU engine, sized for the shared 2-core Ray head.

    serve_config_dict(app, prefix, model)   the serving YAML (serve/serve_config.py) of one test app
    register_fresh(name, [(path, tags)])    the model registered anew in the test stack's MLflow
    ReplicaTimeline(target)                 the app's engine replicas' state changes, polled in a thread
    ChatLoad(base_url, streams)             a bounded loopback load of chat completions, each request timed
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

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


class ReplicaTimeline:
    """Polls the app's engine replicas and records each replica's state changes as (seconds since start, id, state);
    `nodes` maps each current replica to its Ray node id."""

    def __init__(self, target, every_s: float = 0.5):
        self.target, self.every_s = target, every_s
        self.events: list[tuple[float, str, str]] = []
        self.running = self.replicas = 0
        self.nodes: dict[str, str] = {}
        self._states: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                replicas = [r for r in self.target.replicas() if r["deployment"].startswith("LLMServer")]
            except Exception:  # a slow dashboard answer: the next poll catches up
                continue
            now = {r["replica_id"]: r["state"] for r in replicas}
            for rid in set(now) | set(self._states):
                state = now.get(rid, "GONE")
                if self._states.get(rid) != state:
                    self.events.append((round(time.monotonic() - self.started, 1), rid[-8:], state))
            self._states = now
            self.nodes = {r["replica_id"]: r["node_id"] for r in replicas}
            self.replicas = len(now)
            self.running = sum(1 for s in now.values() if s == "RUNNING")

    def running_ids(self) -> set[str]:
        return {rid for rid, state in self._states.items() if state == "RUNNING"}

    def __enter__(self) -> "ReplicaTimeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.5)
        return False


@dataclass
class Request:
    start: float
    end: float
    ok: bool
    error: str = ""


class ChatLoad:
    """`streams` threads sending chat completions back to back over loopback (the `openai` client, no retries)
    until stopped; every request is recorded with its start and end (time.monotonic()) and outcome."""

    def __init__(self, base_url: str, streams: int, max_tokens: int = 48):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        self.max_tokens = max_tokens
        self.requests: list[Request] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True) for _ in range(streams)]

    def _stream(self) -> None:
        while not self._stop.is_set():
            start, error = time.monotonic(), ""
            try:
                r = self.client.chat.completions.create(
                    model="rayline", messages=[{"role": "user", "content": "Count: 1 2 3"}],
                    max_tokens=self.max_tokens, extra_body={"ignore_eos": True})
                ok = bool(r.choices[0].message.content)
            except Exception as e:
                ok, error = False, f"{type(e).__name__}: {e}"[:300]
            with self._lock:
                self.requests.append(Request(start, time.monotonic(), ok, error))

    def __enter__(self) -> "ChatLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)

    def counts(self) -> dict[str, int]:
        with self._lock:
            ok = sum(r.ok for r in self.requests)
            return {"ok": ok, "failed": len(self.requests) - ok}
