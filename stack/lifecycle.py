"""The embedded local platform: a Ray head, an MLflow tracking server, Prometheus (where installed) and (with
--s3) a Swift S3 store.

`python -m pipelines.stack` (up, status, env, down) is its command line.

Everything binds to 127.0.0.1 and lives under the state dir (default `.rayline/`, 0700): process ids and
the config in `stack.json`, logs in `logs/`, the MLflow SQLite store and artifacts in `mlflow/`, the
Ray auth token in `ray_auth_token`, the other secrets in `credentials/` (S3 keys, the webhook secret, Redis's TLS
key; each made at random once per state dir, 0600 from creation, core/secret_files.py), Swift's rings and
objects in `swift/`, Prometheus's config and TSDB in `prometheus/` (stack/prometheus.py). No secret goes on a
command line: processes get file paths. What each part runs is stack/parts.py. Each process runs in
the foreground of its own session, so `down` can stop exactly the processes it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from core import api_keys
from stack import gcs_store, mlflow_auth, objectstore, parts as stack_parts, prometheus
from core.config import ConfigError, apply_overrides, from_dict, to_dict
from stack.processes import kill_session_and_wait, pid_alive
from core.node_labels import NODE_LABEL
from stack.ray_node import alive_nodes, worker_node_name, worker_node_ports
from core.secret_files import ensure_secret, private_dir
from stack.config import PROJECT_ROOT, StackConfig
from stack.parts import env_vars, ray_token, ray_token_path, runs_prometheus, webhook_secret_path  # noqa: F401 (env_vars: the exports of `stack env`)


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError:
            return True


def _http_ok(url: str, timeout: float = 2.0, token: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def _gcs_namespace(cfg: StackConfig) -> str:
    """The head's namespace in Redis: kept while the stack runs, so a head started again after its GCS died comes
    back with the cluster's state; `down` drops it, so a fresh stack starts a fresh cluster."""
    data = read_state(cfg.state)
    if not data.get("gcs_namespace"):
        data["gcs_namespace"] = gcs_store.new_namespace()
        _write_state(cfg.state, data)
    return data["gcs_namespace"]


def node_ids(cfg: StackConfig) -> dict[str, set[str]]:
    """The node ids of the cluster's alive nodes by their `rayline.io/node` label. A node lost a moment ago is
    still listed until the GCS's health checks give up on it."""
    token = ray_token(cfg)
    out: dict[str, set[str]] = {}
    for n in alive_nodes(cfg.dashboard_port, token):
        out.setdefault((n.get("labels") or {}).get(NODE_LABEL), set()).add(n.get("node_id"))
    return out


def part_healthy(cfg: StackConfig, part: str) -> bool:
    if part == "ray":
        token = ray_token(cfg)
        return _http_ok(f"http://127.0.0.1:{cfg.dashboard_port}/api/version", token=token)
    if part == "mlflow":
        return _http_ok(f"http://127.0.0.1:{cfg.mlflow_port}/health")
    if part == "s3":
        return objectstore.healthy(cfg.state, cfg.s3_port)
    if part == "prometheus":
        return prometheus.healthy(cfg.prometheus_port)
    if part == "redis":
        return gcs_store.healthy(cfg.state, cfg.redis_port)
    if part == "nodes":
        pids, labels = read_state(cfg.state)["pids"], node_ids(cfg)
        return all(f"worker-{i}" in labels and pid_alive(pids.get(worker_node_name(i), -1))
                   for i in range(1, cfg.nodes + 1))
    raise ValueError(part)


def _head_registered(cfg: StackConfig, since_ms: int) -> bool:
    """A head node started at `since_ms` or later is alive in the GCS: its raylet registered. The dashboard answers
    before that, and a raylet that cannot register within Ray's 30 s (a GCS still reloading its tables from Redis
    on a loaded box) takes `ray start --block`, and so the whole head, down with it."""
    token = ray_token(cfg)
    return any(n.get("is_head_node") and (n.get("start_time_ms") or 0) >= since_ms
               for n in alive_nodes(cfg.dashboard_port, token))


def read_state(state: Path) -> dict:
    f = state / "stack.json"
    return json.loads(f.read_text()) if f.exists() else {"pids": {}}


def _write_state(state: Path, data: dict) -> None:
    (state / "stack.json").write_text(json.dumps(data, indent=2))


def _spawn(state: Path, name: str, argv: list[str], extra_env: dict[str, str]) -> int:
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **extra_env}
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=str(PROJECT_ROOT), start_new_session=True)
    return proc.pid


def up(cfg: StackConfig, parts: Iterable[str] | None = None) -> dict:
    """Start every part (or only `parts`: "redis", "ray", "mlflow", "s3", "prometheus", "nodes") that is not already healthy;
    wait until each answers. Idempotent. `notes` in the result says why a part that is on did not start."""
    state = private_dir(cfg.state)  # 0700: the credentials, logs and data of every part are the user's alone
    private_dir(state / "credentials")  # before any part makes its own folder in it (mkdir's parents get 0755)
    (state / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
    ensure_secret(ray_token_path(cfg))
    ensure_secret(webhook_secret_path(cfg))
    api_keys.create_stack_keys(state)  # the OpenAI endpoint's client and admin keys (0600) and their hashes
    namespace = _gcs_namespace(cfg) if cfg.gcs_redis else ""
    specs = {part: procs for part, procs in stack_parts.specs(cfg, namespace).items() if parts is None or part in parts}
    if "s3" in specs:
        reason = objectstore.available()
        if reason:
            raise RuntimeError(f"--s3: {reason}")
    if "redis" in specs and gcs_store.available():
        raise RuntimeError(f"gcs_redis: {gcs_store.available()}")
    notes = []
    if cfg.prometheus and prometheus.available() and (parts is None or "prometheus" in parts):
        notes.append(f"prometheus not started: {prometheus.available()}")
    data = read_state(state)
    data["config"] = to_dict(cfg)
    to_start = [part for part in specs if not part_healthy(cfg, part)]
    # Check every port before starting anything, so a clash leaves nothing half started.
    for part in to_start:
        if any(pid_alive(data["pids"].get(n, -1)) for n, _, _ in specs[part]):
            continue  # ours, still starting
        busy = [p for p in stack_parts.ports(cfg)[part] if port_busy(p)]
        if busy:
            raise RuntimeError(
                f"{part}: port {busy[0]} on 127.0.0.1 is already in use by another process; pick another "
                f"(e.g. `python -m pipelines.stack up {part}_port=...`, see StackConfig) or stop that process"
            )
    started: list[str] = []
    deadline = time.time() + cfg.timeout_s
    head_since_ms = None  # set when this call starts the head: its raylet must register, not just its dashboard answer
    ready = {"ray": lambda: part_healthy(cfg, "ray") and (head_since_ms is None or _head_registered(cfg, head_since_ms))}
    for part in to_start:
        if part == "nodes":  # worker nodes join a head that answers
            _wait_healthy(cfg, "ray", specs["ray"] if "ray" in specs else [], data, deadline, ready["ray"])
        if part == "ray":
            head_since_ms = int(time.time() * 1000) - 1000
        data.setdefault("parts", {})[part] = [n for n, _, _ in specs[part]]
        for name, argv, env in specs[part]:
            if not pid_alive(data["pids"].get(name, -1)):
                label = name.removeprefix("ray-")
                lost = node_ids(cfg).get(label, set()) if part == "nodes" else set()
                if part == "nodes" and name in data["pids"]:
                    _clear_lost_node(cfg, data["pids"][name], int(label.removeprefix("worker-")))
                data["pids"][name] = _spawn(state, name, argv, env)
                started.append(name)
                if part == "nodes":
                    # One at a time: raylets starting together in one Ray session can pick the same socket name.
                    # A node that replaces a lost one counts once it joined under a new node id.
                    _write_state(state, data)
                    restarts = _join_node(cfg, state, data, (name, argv, env), deadline,
                                          lambda: bool(node_ids(cfg).get(label, set()) - lost))
                    if restarts:
                        notes.append(f"{name}: joined after {restarts} restart(s) ({restarts[-1]})")
        _write_state(state, data)
    _write_state(state, data)
    for part in specs:
        _wait_healthy(cfg, part, specs[part], data, deadline, ready.get(part))
    if "mlflow" in specs:  # the roles, the evidence experiment and the production models (stack/mlflow_auth.py)
        mlflow_auth.provision(f"http://127.0.0.1:{cfg.mlflow_port}", state, cfg.production_models)
    if "s3" in specs:
        objectstore.ensure_bucket(state, cfg.bucket, cfg.s3_port)
    return {"started": started, "state_dir": str(state), "notes": notes}


def _clear_lost_node(cfg: StackConfig, old_pid: int, i: int, timeout_s: float = 30.0) -> None:
    """Before worker node i starts again: whatever its lost predecessor (session `old_pid`) left is killed, and its
    fixed ports are free. A node killed from inside (a fault that SIGKILLs its own session) may still be dying
    when `up` runs, and a raylet whose agent finds its port taken gives up ("port conflict")."""
    kill_session_and_wait(old_pid)
    deadline = time.time() + timeout_s
    while any(port_busy(p) for p in worker_node_ports(cfg, i).values()) and time.time() < deadline:
        time.sleep(0.2)


def _join_node(cfg: StackConfig, state: Path, data: dict, spec: tuple, deadline: float, joined) -> list[str]:
    """Wait until a worker node joined; start it again, as a pod's container restarts, when its `ray start` exited
    first, until `deadline`. Ray gives a raylet 30 s (hard-coded) to register with the GCS, and on a box whose CPUs
    are all busy (engines at work on the other nodes) its agents may need longer to start. Returns why it was
    restarted (the last lines of each failed start's log)."""
    name, argv, env = spec
    restarts = []
    while True:
        try:
            _wait_healthy(cfg, "nodes", [spec], data, deadline, joined)
            return restarts
        except RuntimeError as e:
            if time.time() > deadline or " exited;" not in str(e):
                raise
            why = str(e).rsplit("\n", 1)[-1].strip()
            restarts.append("its raylet missed Ray's 30 s registration window" if "timed out during startup" in str(e)
                            else why)
            _clear_lost_node(cfg, data["pids"][name], int(name.rsplit("-", 1)[1]))  # what the failed start left
            data["pids"][name] = _spawn(state, name, argv, env)
            _write_state(state, data)


def _wait_healthy(cfg: StackConfig, part: str, procs: list, data: dict, deadline: float, ready=None) -> None:
    """Wait until `part` answers (or `ready()` says so); fail at once, naming its log, when one of its
    processes has exited."""
    while not (ready() if ready else part_healthy(cfg, part)):
        dead = [n for n, _, _ in procs if not pid_alive(data["pids"].get(n, -1))]
        if dead or time.time() > deadline:
            why = f"{dead[0]} exited" if dead else f"no answer after {cfg.timeout_s}s"
            log = cfg.state / "logs" / ((dead or [part])[0] + ".log")
            raise RuntimeError(f"{part}: {why}; see {log}{_log_tail(log)}")
        time.sleep(0.5)


def _log_tail(log: Path, lines: int = 6) -> str:
    """The last lines of a part's log, for an error message ("" when there is none)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4000))
            tail = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()][-lines:]
    except OSError:
        return ""
    return ("; its log ends:\n  " + "\n  ".join(tail)) if tail else ""


def down(cfg: StackConfig, grace_s: float = 10.0, parts: Iterable[str] | None = None) -> list[str]:
    """Stop the processes `up` started (or only those of `parts`, e.g. ["nodes"]): SIGTERM, then SIGKILL for
    whatever of their session is left.

    Ray's workers leave their parent's process group but not its session, so the session is what
    identifies everything a part started. Data is kept.
    """
    data = read_state(cfg.state)
    names = None if parts is None else {n for part in parts for n in data.get("parts", {}).get(part, [])}
    pids = {n: p for n, p in data["pids"].items() if names is None or n in names}
    stopped = []
    for name, pid in reversed(list(pids.items())):
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.2)
    lingering = [n for n, p in pids.items() if pid_alive(p)]
    if lingering:
        print(f"stack down: {', '.join(lingering)} still running {grace_s:.0f} s after SIGTERM; killed",
              file=sys.stderr, flush=True)
    for sid in pids.values():
        kill_session_and_wait(sid)  # gone, ports free, before `down` returns
    data["pids"] = {n: p for n, p in data["pids"].items() if n not in pids}
    if parts is None or "ray" in parts:  # a head started later is a new cluster
        data.pop("gcs_namespace", None)
    if parts is not None and "nodes" in parts:  # the stack runs on without worker nodes
        data.get("parts", {}).pop("nodes", None)
        data.get("config", {})["nodes"] = 0
        # The head runs on: return once its GCS no longer counts them, or the next job sizes itself (cluster
        # CPUs, tasks per node) for nodes that are gone and waits forever for their CPUs.
        gone = [n.removeprefix("ray-") for n in pids]
        while time.time() < deadline + 30 and any(label in node_ids(cfg) for label in gone):
            time.sleep(0.2)
    _write_state(cfg.state, data)
    return stopped


def status(cfg: StackConfig) -> dict[str, dict]:
    data = read_state(cfg.state)
    out = {}
    for part, procs in _specs_for_status(cfg).items():
        pids = {n: data["pids"].get(n) for n in procs}
        out[part] = {"healthy": part_healthy(cfg, part),
                     "pids": {n: p for n, p in pids.items() if p and pid_alive(p)}}
    return out


def _specs_for_status(cfg: StackConfig) -> dict[str, list[str]]:
    parts = {**({"redis": ["redis"]} if cfg.gcs_redis else {}), "ray": ["ray-head"], "mlflow": ["mlflow"]}
    if cfg.s3:
        parts["s3"] = read_state(cfg.state).get("parts", {}).get("s3", [])
    if runs_prometheus(cfg):
        parts["prometheus"] = ["prometheus"]
    if cfg.nodes:
        parts["nodes"] = [worker_node_name(i) for i in range(1, cfg.nodes + 1)]
    return parts


def urls(cfg: StackConfig) -> dict[str, str]:
    return {
        "Ray dashboard": f"http://127.0.0.1:{cfg.dashboard_port}",
        "MLflow UI": f"http://127.0.0.1:{cfg.mlflow_port}",
        "OpenAI endpoint": f"http://127.0.0.1:{cfg.serve_port}/v1",
        **({"Prometheus": f"http://127.0.0.1:{cfg.prometheus_port}"} if runs_prometheus(cfg) else {}),
    }


def load_stack_config(state_dir: str | None, overrides: list[str], s3: bool | None = None) -> StackConfig:
    """The config `up` saved in the state dir, with overrides on top (so `env`/`down` need no flags)."""
    base = StackConfig() if state_dir is None else StackConfig(state_dir=state_dir)
    saved = read_state(base.state).get("config") or {}
    data = apply_overrides({**saved, **({"state_dir": state_dir} if state_dir else {})}, overrides)
    if s3 is not None and s3:
        data["s3"] = True
    try:
        return from_dict(StackConfig, data, source=str(base.state / "stack.json"))
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
