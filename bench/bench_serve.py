"""Serving: rayline's Ray Serve LLM app vs vLLM's own OpenAI server, same `small` model, same engine, same load.

    python -m pipelines.stack up                 # the local stack (Ray head + MLflow), or export another stack's env
    python bench/bench_serve.py [--requests 256] [--concurrency 32 64] [--max-tokens 128] [--spread 0.25]
                                [--skip-rollout | --rollout-only]
    python bench/bench_serve.py --quick          # a smoke run: small loads, no rollout

Each server gets `--requests` streamed completions of exactly `--max-tokens` output tokens
(ignore_eos; `--spread`: lengths drawn around it, see bench/serve_load.py) from `--concurrency` concurrent
clients on loopback, `--rounds` times in alternating order
(A-B-C, C-B-A: the machine's speed drifts; the `vllm defaults` server in the first round only); reported
over all rounds: output tokens/s and time to first token p50/p99. The servers:
  vllm server    `python -m vllm.entrypoints.openai.api_server` with the engine arguments and the engine
                 environment (`serve.engine.runtime_env`) rayline's serving config gives its engine, so only
                 the serving path differs. Without that environment vLLM on CPU turns the `uni` executor
                 into `mp` (a third process, busy-polling shared memory) and the work is not the same.
  vllm defaults  the same server as `vllm serve MODEL` runs it, with vLLM's own defaults: only the KV cache
                 size (vLLM's CPU default takes most of the RAM), the names and the port are given. Not equal
                 terms; a reference point.
  rayline        the Serve LLM app on the local stack, with the same engine config.
Each side's effective set-up is read back from its running processes and from what its engine logged,
and printed (bench/equal_terms.py). Then the rollout time of the `tiny` model (alias set -> new version
answering) is measured with the real rollout. The last lines are the throughput ratios, one per
comparison; rayline vs vllm server only when the set-ups agree on MUST_MATCH.
The cost of rayline's own serving metrics is bench/bench_serve_metrics.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import (  # noqa: E402
    THREAD_ENV, busy_threads, print_setups, ratio_line, round_order, thread_times,
)
from bench.serve_load import LoadResult, combine, run_load  # noqa: E402
from bench.serve_setup import (  # noqa: E402
    engine_core_pid, engine_setup, resolve_scheduler, serve_ingress, title,
)
from pipelines.config import from_dict, to_dict  # noqa: E402
from serve import engine as eng  # noqa: E402
from serve.app import ServedModel, render_serve_config  # noqa: E402
from serve.deploy_target import LocalServe  # noqa: E402
from serve.serve_config import Config as ServeConfig  # noqa: E402
from serve.verify import wait_until_answering, wait_until_healthy  # noqa: E402

ENGINE = {
    "accelerator": "cpu", "max_model_len": 512, "max_num_seqs": 64, "dtype": "float32", "enforce_eager": True,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "kv_cache_memory_bytes": 512 * eng.MiB,
    "cpus_per_engine": 1.0,
    # As configs/serve/tiny_cpu.yaml: one unpinned compute thread (vLLM would pin it to core 0). Both servers.
    "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
}
# The tuned serving settings (serve/serve_config.py): one ingress, no access log, and streamed tokens passed
# on as they come (stream_batching_interval_ms 0): at a few tokens/s per stream on CPU a batching window
# merges nothing, but its timer wakes every stream 20 times a second and delays the first token.
SERVE = {"app_name": "rayline-bench", "route_prefix": "/", "served_model_id": "rayline", "ingress_cpus": 0.1,
         "ingress_replicas": 1, "max_ongoing_requests": 512, "stream_batching_interval_ms": 0.0}


# What must be equal for a ratio between rayline and the vllm server: the engine, its process layout and its
# compute threads (read back from the threads' CPU time: EngineCore's environment cannot be read from /proc
# once it has set its title, so the environment each side was given is shown beside it).
MUST_MATCH = ["executor", "engine processes", "engine niceness", "engine busy threads", "dtype", "max_seq_len",
              "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "max_num_batched_tokens",
              "KV cache tokens", "stats logging"]
VLLM = "vllm server"
DEFAULTS = "vllm serve, its own defaults (not equal terms)"


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
        """With rayline's engine arguments and engine environment, as serve/engine.py prescribes for plain vLLM."""
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
        model = self.model = ServedModel(source=str(model_dir), ref=str(model_dir))
        self.target = LocalServe(self.cfg.app_name)
        self.url = self.cfg.base_url()
        start = time.time()
        self.target.apply(render_serve_config(self.cfg, model, adapters))
        healthy = wait_until_healthy(self.target.state, model, 900, fail_fast=False, applied_at=start)
        answer = healthy.ok and wait_until_answering(self.url, self.cfg.served_model_id, model.label, "hi", 120).ok
        if not answer:
            self.stop()
            raise RuntimeError(f"rayline app did not come up: {healthy.reason}")

    def replica_pid(self) -> int | None:
        """The Serve replica that runs the engine: its title names the app, and it has started EngineCore."""
        import psutil

        tag = f"ServeReplica:{self.cfg.app_name}:"
        for proc in psutil.process_iter():
            try:
                # The replica, not its forked EngineCore (which carries the replica's title too).
                if (tag in title(proc) and tag not in title(proc.parent())
                        and engine_core_pid(proc.pid)):
                    return proc.pid
            except (psutil.Error, OSError, IndexError):
                continue
        return None

    def engine_pid(self) -> int | None:
        replica = self.replica_pid()
        return engine_core_pid(replica) if replica else None

    def setup(self) -> dict:
        """The engine's replica read back like a vLLM server; its logs are the replica's stdout and stderr (Ray's
        worker logs). The environment given is the one the app gives the replica (serve/app.py)."""
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


def bench_rollout(work: Path) -> float:
    """Seconds from setting the alias to the new version answering, with the tiny model and the real rollout."""
    from pipelines import registry
    from pipelines.tiny_model import build_tiny_model
    from serve.rollout import DEPLOYED, Rollout
    from serve.rollout_config import Config as RolloutConfig

    name = "rayline-bench-tiny"
    dirs = [build_tiny_model(work / f"tiny-{s}", "tiny", seed=s) for s in (0, 1)]
    try:
        registry.client().delete_registered_model(name)
    except Exception:
        pass
    with registry.start_run("rayline-bench", "register-tiny") as run:
        versions = [registry.register_checkpoint(name, str(d), run_id=run.info.run_id,
                                                 tags={"eval.exact_match": "1.0"}).version for d in dirs]
    tiny_engine = {**ENGINE, "max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory_bytes": 64 * eng.MiB,
                   "cpus_per_engine": 0.5, "model": f"models:/{name}@champion"}
    serve_cfg = from_dict(ServeConfig, {**SERVE, "app_name": "rayline-bench-rollout", "engine": tiny_engine})
    rollout = Rollout(RolloutConfig(model=name, triggered_by="bench"), serve_cfg)
    try:
        registry.set_alias(name, "champion", versions[0])
        first = rollout.once()
        if first.status != DEPLOYED:
            raise RuntimeError(first.line())
        start = time.time()
        registry.set_alias(name, "champion", versions[1])
        second = rollout.once()
        if second.status != DEPLOYED:
            raise RuntimeError(second.line())
        return time.time() - start
    finally:
        rollout.target.delete()


def small_model(work: Path) -> tuple[Path, eng.EngineConfig]:
    """The `small` model under `work` (built once) and the engine config both sides serve it with."""
    model_dir = work / "small"
    if not (model_dir / "model.safetensors").exists():
        from pipelines.tiny_model import build_tiny_model

        build_tiny_model(model_dir, "small", seed=0)
    return model_dir, from_dict(eng.EngineConfig, {"model": str(model_dir), **ENGINE})


def use_local_stack() -> None:
    """Point this process at the local stack (.rayline/) unless a stack's env is already exported."""
    if os.environ.get("RAY_ADDRESS", "").startswith("http"):
        return
    from pipelines import stack

    cfg = stack.load_stack_config(None, [])
    if not (stack.part_healthy(cfg, "ray") and stack.part_healthy(cfg, "mlflow")):
        raise SystemExit("the local stack is not up: `python -m pipelines.stack up` (or export another stack's env)")
    os.environ.update(stack.env_vars(cfg))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.0,
                   help="each request's length drawn from max-tokens x [1 - spread, 1 + spread], the same seeded "
                        "lengths for every server (0: all the same length, so the streams run in waves; "
                        "bench/serve_load.py)")
    p.add_argument("--vllm-port", type=int, default=8199, help="the vllm server's port; its own-defaults twin's is +1")
    p.add_argument("--vllm-nice", type=int, default=15, help="niceness of the vLLM servers (Ray workers run at 15)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"),
                   help="where the models and the vLLM server log go")
    p.add_argument("--rounds", type=int, default=2,
                   help="load runs per server and concurrency, in A-B-C, C-B-A order (the machine's speed drifts)")
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--rollout-only", action="store_true", help="only the rollout time (no load, no vLLM server)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 requests of 32 tokens at 8 streams, "
                   "2 rounds, no rollout")
    args = p.parse_args(argv)
    if not 0.0 <= args.spread < 1.0:
        p.error(f"--spread must be in [0, 1), got {args.spread}")
    if args.quick:
        args.requests, args.concurrency, args.max_tokens, args.rounds, args.skip_rollout = 16, [8], 32, 2, True
    # Stopped by a signal, still run the `finally`s: the vLLM server and the Serve app go away with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    use_local_stack()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, engine_cfg = small_model(work)

    if args.rollout_only:
        rollout_s = bench_rollout(work)
        print(f"rollout time (alias set -> new version answering, tiny): {rollout_s:.1f}s")
        return {"vllm": [], "rayline": [], "rollout_s": rollout_s, "ratios": {}}

    # All servers stay up and take turns, per concurrency, so drifting load on a shared machine hits all
    # alike; an idle one costs next to nothing (each run prints what the idle ones used).
    servers: dict = {}
    results: dict[str, list[LoadResult]] = {VLLM: [], DEFAULTS: [], "rayline": []}
    busy: dict[str, list[int]] = {name: [] for name in results}
    try:
        # Started together: their imports and engine start-ups overlap (minutes on 2 cores, one after another).
        servers[VLLM] = VllmServer.equal_terms(model_dir, engine_cfg, args.vllm_port, work / "vllm_server.log",
                                               args.vllm_nice)
        servers[DEFAULTS] = VllmServer.own_defaults(model_dir, engine_cfg, args.vllm_port + 1,
                                                    work / "vllm_defaults.log", args.vllm_nice)
        servers["rayline"] = RaylineApp(model_dir, engine_cfg)
        servers[VLLM].wait(), servers[DEFAULTS].wait()
        for c in args.concurrency:
            runs: dict[str, list[LoadResult]] = {name: [] for name in results}
            for i, order in enumerate(round_order([VLLM, DEFAULTS, "rayline"], args.rounds)):
                # vLLM's own defaults are a reference point, not equal terms, and ~2.5x slower: one round.
                for name in (n for n in order if n != DEFAULTS or i == 0):
                    idle = {n: cpu_seconds(s) for n, s in servers.items() if n != name}
                    result, threads = timed_load(servers[name], c, args)
                    runs[name].append(result)
                    busy[name] += [threads] if threads is not None else []
                    idle_cpu = ", ".join(f"{n.split(',')[0]} {cpu_seconds(servers[n]) - t:.1f}"
                                         for n, t in idle.items())
                    print(f"{c} streams, round {i + 1}: {name} {runs[name][-1]} (CPU-s of the idle: {idle_cpu})",
                          flush=True)
            for name in results:
                results[name].append(combine(runs[name]))
        setups = {name: {**server.setup(), **busy_setup(busy[name])} for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    unlogged = {n: servers[n].log_path for n in (VLLM, DEFAULTS)
                if setups[n]["max_num_batched_tokens"] == "not logged"}
    for name, sched in resolve_scheduler(unlogged).items():
        setups[name].update({**sched, "max_num_batched_tokens from": "vLLM's EngineArgs on the server's logged args"})
    rollout_s = None if args.skip_rollout else bench_rollout(work)

    lengths = (f"each request {args.max_tokens} tokens" if not args.spread else
               f"request lengths drawn from {args.max_tokens} x [{1 - args.spread:g}, {1 + args.spread:g}], the same for "
               f"every server")
    print(f"\n{args.rounds} rounds per server and concurrency, A-B-C, C-B-A; {lengths}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups({"rayline": setups["rayline"], VLLM: setups[VLLM], "vllm serve (defaults)": setups[DEFAULTS]})
    print(f"{'server':24} {'streams':>7} {'requests':>8} {'failed':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for label, rs in results.items():
        for r in rs:
            print(f"{label.split(',')[0]:24} {r.concurrency:7d} {r.requests:8d} {r.failed:6d} {r.tokens_per_s:8.1f} "
                  f"{r.ttft_p50:8.3f}s {r.ttft_p99:8.3f}s")
    for v, r in zip(results[VLLM], results["rayline"]):
        print(f"TTFT p50 rayline vs vllm server ({v.concurrency} streams): {r.ttft_p50 / v.ttft_p50:.2f}x")
    if rollout_s is not None:
        print(f"rollout time (alias set -> new version answering, tiny): {rollout_s:.1f}s")
    ratios: dict = {}
    for baseline, must_match in ((DEFAULTS, []), (VLLM, MUST_MATCH)):
        for b, r in zip(results[baseline], results["rayline"]):
            ratios[(baseline, b.concurrency)] = r.tokens_per_s / b.tokens_per_s
            print(ratio_line(f"{baseline} ({b.concurrency} streams)", r.tokens_per_s / b.tokens_per_s,
                             setups["rayline"], setups[baseline], must_match))
    return {"results": results, "setups": setups, "rollout_s": rollout_s, "ratios": ratios}


def timed_load(server, concurrency: int, args, model: str = "rayline") -> tuple[LoadResult, int | None]:
    """One load run on a server (requests naming `model`), and how many of its engine's threads were busy during
    it (None: no engine)."""
    engine_pid = server.engine_pid()
    before = thread_times(engine_pid) if engine_pid else {}
    spread = getattr(args, "spread", 0.0)  # bench_lora and bench_serve_metrics share this and have no --spread
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


if __name__ == "__main__":
    main()
