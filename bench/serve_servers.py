"""What the serving benches share (bench_serve.py, bench_lora.py, bench_serve_metrics.py, bench_canary.py): the
`small` model's engine and serving settings, the two servers they compare (vLLM's OpenAI server in a process of its
own; rayline's Serve app on the local stack), each read back for its effective set-up, and one timed load run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.equal_terms import THREAD_ENV, busy_threads, thread_times
from bench.serve_load import LoadResult, run_load
from bench.serve_setup import engine_core_pid, engine_setup, serve_ingress, title
from core.config import from_dict, to_dict
from serve.online import engine as eng
from serve.online.app import ServedModel, render_serve_config
from serve.promotion.deploy_target import LocalServe
from serve.online.serve_config import Config as ServeConfig
from serve.promotion.verify import admin_key, wait_until_answering, wait_until_healthy

ENGINE = {
    "accelerator": "cpu", "max_model_len": 512, "max_num_seqs": 64, "dtype": "auto", "enforce_eager": False,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "kv_cache_memory_bytes": 512 * eng.MiB,
    "cpus_per_engine": 1.0,
    # The precision follows the CPU (dtype auto: serve/online/precision.py) and the compute threads the engine's CPUs
    # (cpus_per_engine 1: one), unpinned (vLLM would pin them to core 0). Compiled (enforce_eager false: EngineConfig's
    # default and vLLM's): on 2026-12-07 an eager engine gave 0.90x / 0.93x of `vllm serve`'s tokens/s, a compiled one
    # 1.13x / 1.10x (1 round), for ~30-50 s more engine start. Both servers. EAGER below is configs/serve/tiny_cpu.yaml's
    # choice for the tiny model, whose rollouts and canaries the benches time.
    "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
}
EAGER = {"enforce_eager": True}
"""As configs/serve/tiny_cpu.yaml: no compile, so a tiny model's replica starts in seconds (rollout and canary timings)."""
# The tuned serving settings (serve/online/serve_config.py): one ingress, no access log, and streamed tokens passed
# on as they come (stream_batching_interval_ms 0): at a few tokens/s per stream on CPU a batching window
# merges nothing, but its timer wakes every stream 20 times a second and delays the first token.
# Every bench app has a name and a route of its own (`/bench...`): a stack where the demo left its app at `/` takes
# them beside it (Serve refuses two apps on one route prefix).
SERVE = {"app_name": "rayline-bench", "route_prefix": "/bench", "served_model_id": "rayline", "ingress_cpus": 0.1,
         "ingress_replicas": 1, "max_ongoing_requests": 512, "stream_batching_interval_ms": 0.0}


# What must be equal for a ratio between rayline and the vllm server: the engine, its process layout and its
# compute threads (read back from the threads' CPU time: EngineCore's environment cannot be read from /proc
# once it has set its title, so the environment each side was given is shown beside it).
MUST_MATCH = ["executor", "engine processes", "engine niceness", "engine busy threads", "dtype", "max_seq_len",
              "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "max_num_batched_tokens",
              "KV cache tokens", "stats logging"]

def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url}: no answer after {timeout_s}s")


def vllm_cli_args(engine_cfg: eng.EngineConfig) -> list[str]:
    """rayline's engine kwargs as `vllm.entrypoints.openai.api_server` flags."""
    args = []
    for k, v in eng.vllm_engine_kwargs(engine_cfg).items():
        flag = "--" + k.replace("_", "-")
        args += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return args


class VllmServer:
    """A vLLM OpenAI server (`args` after the python executable) in a session of its own, at niceness `nice`;
    started here, `wait()` until it answers."""

    def __init__(self, args: list[str], env: dict[str, str], port: int, log_path: Path, nice: int):
        self.url, self.port, self.log_path = f"http://127.0.0.1:{port}/v1", port, log_path
        self.env_given = {k: env.get(k, "unset") for k in THREAD_ENV}
        # Equal terms with rayline's app, where every request's key is checked: vLLM's own key check, on the key the
        # loads send ($OPENAI_API_KEY, serve_load.run_load).
        env = {**env, "VLLM_API_KEY": os.environ.get("OPENAI_API_KEY", "")}
        self.log = open(log_path, "w")
        # Ray starts its workers (Serve replicas, and so the engines they spawn) at niceness 15; on a shared
        # machine the baseline must compete for CPU on the same terms.
        self.proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=lambda: os.nice(nice - os.getpriority(os.PRIO_PROCESS, 0)))

    def wait(self) -> VllmServer:
        wait_http(f"http://127.0.0.1:{self.port}/health", 900, self.proc)
        return self

    @classmethod
    def equal_terms(cls, model_dir: Path, engine_cfg: eng.EngineConfig, port: int, log_path: Path, nice: int):
        """With rayline's engine arguments and engine environment, as serve/online/engine.py prescribes for plain vLLM."""
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
                "rayline", "--disable-uvicorn-access-log", *vllm_cli_args(engine_cfg)]
        env = {**os.environ, **eng.runtime_env(engine_cfg).get("env_vars", {})}
        return cls(args, env, port, log_path, nice)

    @classmethod
    def own_defaults(cls, model_dir: Path, engine_cfg: eng.EngineConfig, port: int, log_path: Path, nice: int):
        """vLLM's OpenAI server with its defaults and none of this process's thread settings, as `vllm serve MODEL`
        runs it (the `vllm` command itself fails here: it looks up the `vllm` distribution, and vLLM for CPU is
        installed as `vllm-cpu`); only the KV cache size is given (vLLM's CPU default reserves most of the RAM
        and fails on a shared box)."""
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "rayline", "--kv-cache-memory-bytes", str(engine_cfg.kv_cache_memory_bytes)]
        env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
        return cls(args, env, port, log_path, nice)

    def engine_pid(self) -> int | None:
        return engine_core_pid(self.proc.pid)

    def setup(self) -> dict:
        return {**engine_setup(self.proc.pid, [self.log_path]), "HTTP ingress": "the API server process (uvicorn)",
                **{f"given {k}": v for k, v in self.env_given.items()}}

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)  # its session: the server and its engine processes
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class RaylineApp:
    """The rayline Serve app (serving config `SERVE` + the same engine) deployed on the local stack."""

    def __init__(self, model_dir: Path, engine_cfg: eng.EngineConfig, overrides: dict | None = None,
                 adapters: dict | None = None):
        self.cfg = from_dict(ServeConfig, {**SERVE, **(overrides or {}), "engine": to_dict(engine_cfg)})
        # Pinned to the bytes hashed here, as pipelines.serve pins them: each replica checks them before loading.
        model = self.model = ServedModel(source=str(model_dir), ref=str(model_dir),
                                         digest=eng.checked_digest(str(model_dir)))
        self.target = LocalServe(self.cfg.app_name)
        self.url = self.cfg.base_url()
        require_route(self.target, self.cfg.app_name, self.cfg.route_prefix)
        start = time.time()
        self.target.apply(render_serve_config(self.cfg, model, adapters))
        healthy = wait_until_healthy(self.target.state, model, 900, fail_fast=False, applied_at=start)
        answer = healthy.ok and wait_until_answering(self.url, self.cfg.served_model_id, model.label, "hi", 120,
                                                     api_key=admin_key(self.cfg)).ok
        if not answer:
            self.stop()
            raise RuntimeError(f"rayline app did not come up: {healthy.reason}")

    def replica_pid(self) -> int | None:
        return engine_replica_pid(self.cfg.app_name)

    def engine_pid(self) -> int | None:
        replica = self.replica_pid()
        return engine_core_pid(replica) if replica else None

    def setup(self) -> dict:
        """The engine's replica read back like a vLLM server; its logs are the replica's stdout and stderr (Ray's
        worker logs). The environment given is the one the app gives the replica (serve/online/app.py)."""
        replica = self.replica_pid()
        if replica is None:
            import psutil

            seen = [f"{p.pid} (parent {p.ppid()}): {name[:80]}" for p in psutil.process_iter()
                    if "ServeReplica" in (name := title(p))]
            print("no engine replica among: " + "; ".join(seen), flush=True)
            return {"engine processes": f"no ServeReplica:{self.cfg.app_name} process with an EngineCore child"}
        given = eng.runtime_env(self.cfg.engine).get("env_vars", {})
        return {**engine_setup(replica, [Path(os.readlink(f"/proc/{replica}/fd/{fd}")) for fd in (1, 2)]),
                "HTTP ingress": serve_ingress(replica), **{f"given {k}": given.get(k, "unset") for k in THREAD_ENV}}

    def stop(self) -> None:
        self.target.delete()


def require_route(target: LocalServe, app_name: str, route_prefix: str) -> None:
    """Stop with one line naming what to remove when another Serve app holds `route_prefix` (a bench run that was
    killed before its clean-up): Serve would refuse the deploy with "Found duplicate applications for route
    prefix"."""
    for app in target._declarative_apps(target._details()):
        if app.get("route_prefix") == route_prefix and app.get("name") != app_name:
            raise SystemExit(f"Serve app {app.get('name')!r} holds the route {route_prefix} this bench deploys on: "
                             f"remove it (python -m pipelines.serve --config <its serving config> --delete) and run again")


def engine_replica_pid(app_name: str) -> int | None:
    """The Serve replica of `app_name` that runs the engine: its title names the app, and it has started EngineCore."""
    import psutil

    tag = f"ServeReplica:{app_name}:"
    for proc in psutil.process_iter():
        try:
            # The replica, not its forked EngineCore (which carries the replica's title too).
            if tag in title(proc) and tag not in title(proc.parent()) and engine_core_pid(proc.pid):
                return proc.pid
        except (psutil.Error, OSError, IndexError):
            continue
    return None


def replica_engine(app_name: str) -> str:
    """The engine an app's replica runs, read back (bench/serve_setup.engine_setup on the replica and its logs) as
    one line: its EngineCore and what vLLM logged of its settings."""
    replica = engine_replica_pid(app_name)
    if replica is None:
        return f"no ServeReplica:{app_name} process with an EngineCore child"
    setup = engine_setup(replica, [Path(os.readlink(f"/proc/{replica}/fd/{fd}")) for fd in (1, 2)])
    keys = ("executor", "engine processes", "engine niceness", "dtype", "max_seq_len", "enable_prefix_caching",
            "enable_chunked_prefill", "enforce_eager", "max_num_batched_tokens", "KV cache tokens")
    return f"replica pid {replica}: " + ", ".join(f"{k}={setup.get(k, 'not read back')}" for k in keys)


def small_model(work: Path) -> tuple[Path, eng.EngineConfig]:
    """The `small` model under `work` (built once) and the engine config both sides serve it with."""
    model_dir = work / "small"
    if not (model_dir / "model.safetensors").exists():
        from stack.tiny_model import build_tiny_model

        build_tiny_model(model_dir, "small", seed=0)
    return model_dir, from_dict(eng.EngineConfig, {"model": str(model_dir), **ENGINE})


def use_local_stack() -> None:
    """Point this process at the local stack (.rayline/) unless a stack's env is already exported."""
    if os.environ.get("RAY_ADDRESS", "").startswith("http"):
        return
    from stack import lifecycle as stack

    cfg = stack.load_stack_config(None, [])
    if not (stack.part_healthy(cfg, "ray") and stack.part_healthy(cfg, "mlflow")):
        raise SystemExit("the local stack is not up: `python -m pipelines.stack up` (or export another stack's env)")
    os.environ.update(stack.env_vars(cfg))


def timed_load(server, concurrency: int, args, model: str = "rayline",
               spread: float = 0.0) -> tuple[LoadResult, int | None]:
    """One load run on a server (requests naming `model`; `spread`: bench/serve_load.py), and how many of its
    engine's threads were busy during it (None: no engine)."""
    engine_pid = server.engine_pid()
    before = thread_times(engine_pid) if engine_pid else {}
    result = run_load(server.url, concurrency, args.requests, args.max_tokens, model, spread)
    return result, busy_threads(before, thread_times(engine_pid)) if engine_pid else None


def busy_setup(counts: list[int]) -> dict:
    """The busy-thread count most load runs saw, and all of them beside it."""
    if not counts:
        return {}
    return {"engine busy threads": max(set(counts), key=counts.count),
            "engine busy threads, each run": ",".join(map(str, counts))}


def cpu_seconds(server) -> float:
    """CPU seconds a server's processes have used so far (the Serve app: every process of this Ray node,
    which is what its idle cost can show up in)."""
    import psutil

    pid = server.proc.pid if isinstance(server, VllmServer) else None
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)] if pid else [
        p for p in psutil.process_iter() if p.name().startswith(("ray::", "raylet", "gcs_server"))]
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total
