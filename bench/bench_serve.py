"""Serving: rayline's Ray Serve LLM app vs vLLM's own OpenAI server, same `small` model, same engine, same load.

    python -m pipelines.stack up                 # the local stack (Ray head + MLflow), or export another stack's env
    python bench/bench_serve.py [--requests 256] [--concurrency 32 64] [--max-tokens 128] [--skip-rollout | --rollout-only]

Each server gets `--requests` streamed completions of exactly `--max-tokens` output tokens
(ignore_eos) from `--concurrency` concurrent clients on loopback, `--rounds` times in A-B-B-A order
(the machine's speed drifts); reported over all rounds: output tokens/s and time to first token p50/p99. vLLM runs as `python -m vllm.entrypoints.openai.api_server` with the
engine arguments rayline's serving config gives its engine (serve/engine.py), so only the serving
path differs. Then the rollout time of the `tiny` model (alias set -> new version answering) is
measured with the real rollout. The last lines are the throughput ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.config import from_dict, to_dict  # noqa: E402
from pipelines.sample_corpus import WORDS  # noqa: E402
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


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    failed: int
    ttfts: list[float] = field(default_factory=list, repr=False)
    tokens: int = 0
    wall_s: float = 0.0


def combine(results: list[LoadResult]) -> LoadResult:
    """Several rounds of one server at one concurrency as one result: tokens over time, TTFTs pooled."""
    ttfts = [t for r in results for t in r.ttfts]
    tokens, wall = sum(r.tokens for r in results), sum(r.wall_s for r in results)
    return LoadResult(results[0].concurrency, sum(r.requests for r in results), tokens / wall,
                      percentile(ttfts, 0.5), percentile(ttfts, 0.99), sum(r.failed for r in results), ttfts, tokens, wall)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


async def _one(client, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streamed completion -> (time to first token, output tokens)."""
    body = {"model": "rayline", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, ttft, last = time.perf_counter(), None, ""
    async with client.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = line
    usage = json.loads(last[len("data: "):]).get("usage") or {}
    return ttft or float("nan"), int(usage.get("completion_tokens", 0))


async def _load(url: str, concurrency: int, requests: int, max_tokens: int) -> LoadResult:
    import httpx

    prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(32)) for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts, tokens, failed = [], [], 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker():
            nonlocal failed
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    ttft, n = await _one(client, url, prompt, max_tokens)
                    ttfts.append(ttft)
                    tokens.append(n)
                except Exception:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LoadResult(concurrency, requests, sum(tokens) / wall, percentile(ttfts, 0.5), percentile(ttfts, 0.99), failed,
                      ttfts, sum(tokens), wall)


def run_load(url: str, concurrency: int, requests: int, max_tokens: int) -> LoadResult:
    asyncio.run(_load(url, min(4, concurrency), min(8, requests), 16))  # warm-up: connections, caches
    return asyncio.run(_load(url, concurrency, requests, max_tokens))


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
    """`python -m vllm.entrypoints.openai.api_server` with rayline's engine arguments, in a session of its own."""

    def __init__(self, model_dir: Path, engine_cfg: eng.EngineConfig, port: int, log_path: Path, nice: int):
        self.url = f"http://127.0.0.1:{port}/v1"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "rayline", "--host", "127.0.0.1", "--port", str(port),
               "--disable-uvicorn-access-log", *vllm_cli_args(engine_cfg)]
        self.log = open(log_path, "w")
        env = {**os.environ, **engine_cfg.env_vars}
        # Ray starts its workers (Serve replicas, and so the engines they spawn) at niceness 15; on a shared
        # machine the baseline must compete for CPU on the same terms.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=lambda: os.nice(nice))
        wait_http(f"http://127.0.0.1:{port}/health", 900, self.proc)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)  # its session: the server and its engine processes
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class RaylineApp:
    """The rayline Serve app (serving config `SERVE` + the same engine) deployed on the local stack."""

    def __init__(self, model_dir: Path, engine_cfg: eng.EngineConfig):
        self.cfg = from_dict(ServeConfig, {**SERVE, "engine": to_dict(engine_cfg)})
        model = ServedModel(source=str(model_dir), ref=str(model_dir))
        self.target = LocalServe(self.cfg.app_name)
        self.url = self.cfg.base_url()
        start = time.time()
        self.target.apply(render_serve_config(self.cfg, model))
        healthy = wait_until_healthy(self.target.state, model, 900, fail_fast=False, applied_at=start)
        answer = healthy.ok and wait_until_answering(self.url, self.cfg.served_model_id, model.label, "hi", 120).ok
        if not answer:
            self.stop()
            raise RuntimeError(f"rayline app did not come up: {healthy.reason}")

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
    p.add_argument("--vllm-port", type=int, default=8199)
    p.add_argument("--vllm-nice", type=int, default=15, help="niceness of the vLLM server (Ray workers run at 15)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"),
                   help="where the models and the vLLM server log go")
    p.add_argument("--rounds", type=int, default=2,
                   help="load runs per server and concurrency, in A-B-B-A order so a drifting machine hits both alike")
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--rollout-only", action="store_true", help="only the rollout time (no load, no vLLM server)")
    args = p.parse_args(argv)
    # Stopped by a signal, still run the `finally`s: the vLLM server and the Serve app go away with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    use_local_stack()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "small"
    if not (model_dir / "model.safetensors").exists():
        from pipelines.tiny_model import build_tiny_model

        build_tiny_model(model_dir, "small", seed=0)
    engine_cfg = from_dict(eng.EngineConfig, {"model": str(model_dir), **ENGINE})

    if args.rollout_only:
        rollout_s = bench_rollout(work)
        print(f"rollout time (alias set -> new version answering, tiny): {rollout_s:.1f}s")
        return {"vllm": [], "rayline": [], "rollout_s": rollout_s, "ratios": {}}

    # Both servers stay up and take turns, per concurrency, so drifting load on a shared machine
    # hits both alike; the idle one costs next to nothing.
    vllm_server = VllmServer(model_dir, engine_cfg, args.vllm_port, work / "vllm_server.log", args.vllm_nice)
    vllm, rayline = [], []
    try:
        app = RaylineApp(model_dir, engine_cfg)
        try:
            for c in args.concurrency:
                runs: dict[str, list[LoadResult]] = {"vllm": [], "rayline": []}
                for i in range(args.rounds):
                    for name in (("vllm", "rayline") if i % 2 == 0 else ("rayline", "vllm")):
                        url = vllm_server.url if name == "vllm" else app.url
                        runs[name].append(run_load(url, c, args.requests, args.max_tokens))
                        print(f"{c} streams, round {i + 1}: {name} {runs[name][-1]}", flush=True)
                vllm.append(combine(runs["vllm"]))
                rayline.append(combine(runs["rayline"]))
        finally:
            app.stop()
    finally:
        vllm_server.stop()
    rollout_s = None if args.skip_rollout else bench_rollout(work)

    print(f"\n{args.rounds} rounds per server and concurrency, A-B-B-A")
    print(f"{'server':10} {'streams':>7} {'requests':>8} {'failed':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for label, results in (("vllm", vllm), ("rayline", rayline)):
        for r in results:
            print(f"{label:10} {r.concurrency:7d} {r.requests:8d} {r.failed:6d} {r.tokens_per_s:8.1f} "
                  f"{r.ttft_p50:8.3f}s {r.ttft_p99:8.3f}s")
    for v, r in zip(vllm, rayline):
        print(f"TTFT p50 rayline vs vllm server ({v.concurrency} streams): {r.ttft_p50 / v.ttft_p50:.2f}x")
    if rollout_s is not None:
        print(f"rollout time (alias set -> new version answering, tiny): {rollout_s:.1f}s")
    ratios = {}
    for v, r in zip(vllm, rayline):
        ratios[v.concurrency] = r.tokens_per_s / v.tokens_per_s
        print(f"rayline vs vllm server ({v.concurrency} streams): {ratios[v.concurrency]:.2f}x")
    return {"vllm": vllm, "rayline": rayline, "rollout_s": rollout_s, "ratios": ratios}


if __name__ == "__main__":
    main()
