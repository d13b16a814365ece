"""What the Serve integration tests deploy: the tiny model on the CPU engine, sized for the shared 2-core Ray head.

    serve_config_dict(app, prefix, model)   the serving YAML (serve/online/serve_config.py) of one test app, with its API keys
    serving_keys()                          the test stack's API keys (client, admin, and one with a small rate)
    register_fresh(name, [(path, tags)])    the model registered anew in the test stack's MLflow
    ReplicaTimeline(target)                 the app's engine replicas' state changes, polled in a thread
    ChatLoad(base_url, streams)             a bounded loopback load of chat completions, each request timed
    serve_node_loss(stack_cfg, model_dir)   the node of one engine replica lost under load (bench/bench_faults.py
                                            prints it)
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
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


class ReplicaTimeline:
    """Polls the app's engine replicas and records each replica's state changes as (seconds since start, id, state);
    `nodes` maps each current replica to its Ray node id. With `watch_nodes` (-> the node ids of interest now, or
    None when unknown) it also records those nodes coming and going in `node_events`: (seconds, node id, "JOINED" or
    "LEFT")."""

    def __init__(self, target, every_s: float = 0.5, watch_nodes=None):
        self.target, self.every_s, self.watch_nodes = target, every_s, watch_nodes
        self.events: list[tuple[float, str, str]] = []
        self.node_events: list[tuple[float, str, str]] = []
        self._watched: set[str] = set()
        self.running = self.replicas = 0
        self.polled_at = 0.0  # time.monotonic() of the last poll the controller answered
        self.nodes: dict[str, str] = {}
        self._states: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.watch_nodes:
                self._poll_nodes()
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
            self.polled_at = time.monotonic()

    def _poll_nodes(self) -> None:
        now = self.watch_nodes()
        if now is None:  # not known this time (e.g. the dashboard did not answer)
            return
        at = self.now()
        self.node_events += [(at, n, "JOINED") for n in sorted(now - self._watched)]
        self.node_events += [(at, n, "LEFT") for n in sorted(self._watched - now)]
        self._watched = now

    def now(self) -> float:
        """Seconds since the timeline started, as its events count them."""
        return round(time.monotonic() - self.started, 1)

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
    fingerprint: str = ""  # "<registered name>/<version>" of the engine that answered
    request_id: str = ""  # sent as `x-request-id`: Serve logs it with the replica that handled the request
    answer_began: float | None = None
    """A streamed request: when its answer began (a 200 status and headers came back, time.monotonic()); None: no
    byte of an answer came (a connection error, an error status) or the request was not streamed."""


class LoadThreads:
    """Client threads (`target(i)` each) running while the `with` block does; `stop` is set on exit and each thread
    joined, bounded."""

    def __init__(self, clients: int, target, join_s: float = 180):
        self.stop = threading.Event()
        self.join_s = join_s
        self.threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.join_s)


class ChatLoad(LoadThreads):
    """`streams` threads sending chat completions back to back over loopback (the `openai` client, no retries)
    until stopped; every request is recorded with its start and end (time.monotonic()) and outcome. With several
    base URLs (e.g. the proxies of several nodes) the streams take them in turn. With `pause_s`, each stream waits
    that long after each answer (a paced load that leaves the machine CPU for what else must run, e.g. a head
    restarting, as it would on nodes of its own). With `stream`, each answer is streamed (`stream=True`): a request
    records when its answer began (`Request.answer_began`) and is answered only if the stream ran to its finish
    reason."""

    def __init__(self, base_url: str | list[str], streams: int, max_tokens: int = 48, pause_s: float = 0.0,
                 stream: bool = False):
        super().__init__(streams, self._stream, join_s=150)
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.clients = [openai_client(u) for u in urls]
        self.max_tokens, self.pause_s, self.stream = max_tokens, pause_s, stream
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def _stream(self, i: int) -> None:
        client = self.clients[i % len(self.clients)]
        while not self.stop.is_set():
            start, error, request_id = time.monotonic(), "", f"{REQUEST_ID_PREFIX}{uuid.uuid4().hex[:20]}"
            began = None
            try:
                r = client.chat.completions.create(
                    model="rayline", messages=[{"role": "user", "content": "Count: 1 2 3"}],
                    max_tokens=self.max_tokens, extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": request_id}, stream=self.stream)
                if self.stream:  # create() returns once the 200 status and headers are in
                    began, text, finish, fingerprint = time.monotonic(), "", None, ""
                    with r:
                        for chunk in r:
                            fingerprint = chunk.system_fingerprint or fingerprint
                            for choice in chunk.choices:
                                text += choice.delta.content or ""
                                finish = choice.finish_reason or finish
                    ok = bool(text) and finish is not None
                    error = "" if ok else f"the stream ended without its finish reason after {len(text)} chars"
                else:
                    ok, fingerprint = bool(r.choices[0].message.content), r.system_fingerprint or ""
            except Exception as e:
                ok, error, fingerprint = False, f"{type(e).__name__}: {e}"[:300], ""
            with self._lock:
                self.requests.append(Request(start, time.monotonic(), ok, error, fingerprint, request_id, began))
            if self.pause_s:
                self.stop.wait(self.pause_s)

    def counts(self) -> dict[str, int]:
        with self._lock:
            ok = sum(r.ok for r in self.requests)
            return {"ok": ok, "failed": len(self.requests) - ok}


NODE_LOSS_APP, NODE_LOSS_PREFIX, NODE_LOSS_MODEL = "rayline-test-node-loss", "/node-loss-test", "rayline-node-loss-test"
REQUEST_ID_PREFIX = "rlt-"
_ACCESS_LINE = re.compile(rf"\b({REQUEST_ID_PREFIX}[0-9a-f]{{20}})\b.* -- .*?\b(\d{{3}}|OK|ERROR) [\d.]+ms$", re.M)


def handled_by(cfg, app: str) -> dict[str, list[tuple[str, str]]]:
    """Request id -> [(replica log file, status)] of every request a replica of `app` finished, from Serve's access
    log lines in the stack's replica logs (every node of a stack on this machine logs under the head's temp dir).
    A replica writes a request's line when the request ends, whatever its status; one killed mid-request writes
    none for it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for log in sorted(Path(cfg.ray_temp_dir).glob("session_*/logs/serve/replica_*.log")):
        if app not in log.name:
            continue
        for m in _ACCESS_LINE.finditer(log.read_text(errors="replace")):
            out.setdefault(m.group(1), []).append((log.name, m.group(2)))
    return out


@dataclass
class NodeLoss:
    """What happened when worker-1 was lost under load: every request (times relative to time.monotonic()), when
    the node was killed, back, and the app at full capacity again (None: not within the limit), the replicas'
    nodes before and after, and the replica timeline."""

    streams: int
    requests: list[Request]
    killed_at: float
    joined_at: float
    recovered_at: float | None
    nodes_before: dict[str, str]
    nodes_after: dict[str, str]
    placed: dict[str, str]
    replaced: dict[str, str]
    lost_replica: str
    events: list = field(default_factory=list)
    timeline_started: float = 0.0
    handled: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """Request id -> [(replica log file, status)]: the replicas that finished it (`handled_by`)."""
    streamed: bool = False

    @property
    def noticed_at(self) -> float | None:
        """When Serve's controller reported the lost replica STOPPING or GONE (time.monotonic())."""
        times = [t for t, rid, state in self.events
                 if self.lost_replica.endswith(rid) and state in ("STOPPING", "GONE")]
        return self.timeline_started + min(times) if times and self.lost_replica else None

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    @property
    def failed_unanswered(self) -> list[Request]:
        """Failed requests that had received no byte of an answer: another replica could have taken each."""
        return [r for r in self.failed if r.answer_began is None]

    def summary(self) -> dict:
        return {
            "streams": self.streams, "streamed": self.streamed, "requests": len(self.requests),
            "failed": len(self.failed), "failed_in_flight_at_kill": sum(r.start < self.killed_at for r in self.failed),
            "failed_with_no_byte": len(self.failed_unanswered),
            "replica_marked_down_s": None if self.noticed_at is None else round(self.noticed_at - self.killed_at, 1),
            "node_rejoined_s": round(self.joined_at - self.killed_at, 1),
            "full_capacity_s": None if self.recovered_at is None else round(self.recovered_at - self.killed_at, 1),
            "failed_started_s": [round(r.start - self.killed_at, 1) for r in self.failed],
            "errors": sorted({r.error[:120] for r in self.failed}),
        }


def serve_node_loss(cfg, model_dir: str | Path, streams: int = 6, warm_s: float = 8.0,
                    recover_limit_s: float = 300.0, stream: bool = False) -> NodeLoss:
    """Deploy the tiny model with `python -m pipelines.serve`, two replicas pinned to worker-1 and worker-2 of the
    stack `cfg` (1-CPU nodes: one replica each); put `streams` loopback streams on it (each answer streamed with
    `stream`); after `warm_s` lose worker-1 (`stack_faults.kill_node`) and bring a fresh one back
    (`stack.up(parts=["nodes"])`, as KubeRay replaces a pod); wait until two replicas serve again with the lost one
    gone, keep the load `warm_s` more, and remove the app."""
    from stack import faults as stack_faults, lifecycle as stack
    from serve.promotion.deploy_target import LocalServe

    (version,) = register_fresh(NODE_LOSS_MODEL, [(str(model_dir), {})])
    registry.set_alias(NODE_LOSS_MODEL, "champion", version)
    target = LocalServe(NODE_LOSS_APP)
    try:
        # Each replica logs every request it finishes with its id (access log, written at once): which replica
        # handled each request (`handled_by`).
        deploy(on_worker_nodes({**serve_config_dict(NODE_LOSS_APP, NODE_LOSS_PREFIX, NODE_LOSS_MODEL), "access_log": True,
                                "runtime_env": {"env_vars": {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}}}))
        before = node_ids_by_label(cfg)
        load = ChatLoad(f"http://127.0.0.1:{cfg.serve_port}{NODE_LOSS_PREFIX}/v1", streams, stream=stream)
        with ReplicaTimeline(target) as timeline:
            if not timeline.wait_for(lambda t: t.running == 2, 240):
                raise RuntimeError(f"the two replicas did not start: {timeline.events}")
            placed = dict(timeline.nodes)
            lost = [rid for rid, node in placed.items() if node == before.get("worker-1")]
            with load:
                time.sleep(warm_s)
                killed_at = time.monotonic()
                stack_faults.kill_node(cfg, 1)
                stack.up(cfg, parts=["nodes"])
                joined_at = time.monotonic()
                gone = lost[0] if lost else ""
                recovered = timeline.wait_for(lambda t: t.running == 2 and gone not in t.running_ids(), recover_limit_s)
                recovered_at = time.monotonic() if recovered else None
                replaced = dict(timeline.nodes)
                time.sleep(warm_s)  # the replaced pair under the same load
        loss = NodeLoss(streams, sorted(load.requests, key=lambda r: r.start), killed_at, joined_at, recovered_at,
                        before, node_ids_by_label(cfg), placed, replaced, gone, list(timeline.events), timeline.started,
                        streamed=stream)
    finally:
        target.delete()
    # Read once the replicas have stopped: a replica's access lines may be buffered until then.
    deadline = time.time() + 120
    while target.state().status != "NOT_STARTED" and time.time() < deadline:
        time.sleep(1)
    loss.handled = handled_by(cfg, NODE_LOSS_APP)
    return loss


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
