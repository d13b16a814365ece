"""LoRA serving: an adapter served by rayline vs the same adapter on vLLM's own OpenAI server, the adapter's cost
against the base on the same engine, and the adapter rollout time (issue 18).

    python -m pipelines.stack up                 # the local stack (Ray head + MLflow), or export another stack's env
    python bench/bench_lora.py [--requests 128] [--concurrency 32] [--max-tokens 64] [--rounds 2]
    python bench/bench_lora.py --quick           # a smoke run: small loads

The model is bench/serve_servers.py's `small` model; the adapter a rank-8 PEFT adapter of it on q_proj and v_proj
(random weights, written by peft: pipelines/tiny_model.build_adapter), registered in MLflow as version 1 of
`rayline-bench-lora` (version 2, another seed, is what the rollout swaps in). Both servers run the same engine
arguments and environment, LoRA arguments included (`enable_lora`, `max_lora_rank` 8, `max_loras` 2,
`max_cpu_loras` 3: what rayline's serving config gives one adapter slot), and get the same load in alternating
rounds (A-B-C, C-B-A):
  vllm server, adapter   `python -m vllm.entrypoints.openai.api_server ... --lora-modules rayline:a=<dir>`,
                         requests naming `rayline:a`
  rayline, adapter       the Serve app with `lora.adapters: {a: ...}`, requests naming `rayline:a`
  rayline, base          the same app and engine, requests naming `rayline` (no adapter)
The last lines: rayline vs the vLLM server on the adapter (equal terms: only the serving path differs), and the
adapter vs the base on rayline's one engine (what LoRA itself costs in vLLM on this machine), then the rollout
time of adapter version 2 over version 1 (alias set -> the new version answering) with the real rollout.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_servers import (  # noqa: E402
    MUST_MATCH, RaylineApp, VllmServer, busy_setup, small_model, timed_load, use_local_stack, vllm_cli_args,
)
from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, combine  # noqa: E402
from bench.serve_setup import resolve_scheduler  # noqa: E402
from core import registry  # noqa: E402
from core.config import from_dict  # noqa: E402
from stack.tiny_model import build_adapter  # noqa: E402
from serve.online import engine as eng  # noqa: E402
from serve.online.serve_config import LoraServingConfig  # noqa: E402
from serve.promotion.verify import admin_key, wait_until_answering  # noqa: E402
from serve.batch.tracking import record_figures  # noqa: E402

ADAPTER_MODEL, RANK = "rayline-bench-lora", 8
LORA = {"adapters": {"a": f"models:/{ADAPTER_MODEL}/1"}, "max_lora_rank": RANK}
VLLM, OURS, BASE = "vllm server, adapter", "rayline, adapter", "rayline, base"


def register_adapters(model_dir: Path, work: Path) -> list[str]:
    """Two random adapters of the small model as versions 1 and 2 of ADAPTER_MODEL; their directories."""
    dirs = [str(build_adapter(model_dir, work / f"adapter-{seed}", seed=seed, rank=RANK)) for seed in (1, 2)]
    try:
        registry.client().delete_registered_model(ADAPTER_MODEL)
    except Exception:
        pass
    with registry.start_run("rayline-bench", "register-lora") as run:
        for d in dirs:
            mv = registry.register_checkpoint(ADAPTER_MODEL, d, run_id=run.info.run_id)
            record_figures(ADAPTER_MODEL, mv.version, {"exact_match": 1.0})  # the gate's evidence
    return dirs


def lora_setup(kwargs: dict) -> dict:
    """The LoRA engine arguments a side was given, as set-up rows."""
    return {f"given {k}": v for k, v in kwargs.items()}


def bench_adapter_rollout(app: RaylineApp) -> float:
    """Seconds from setting `champion` on adapter version 2 to it answering behind `rayline:a` (the real rollout,
    in place on the running app)."""
    from serve.promotion.outcome import DEPLOYED
    from serve.promotion.rollout import Rollout
    from serve.promotion.rollout_config import Config as RolloutConfig

    rollout = Rollout(from_dict(RolloutConfig, {"adapter": "a", "triggered_by": "bench"}), app.cfg, target=app.target)
    start = time.time()
    registry.set_alias(ADAPTER_MODEL, "champion", "2")
    result = rollout.once()
    if result.status != DEPLOYED:
        raise RuntimeError(result.line())
    return time.time() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm-port", type=int, default=8197)
    p.add_argument("--vllm-nice", type=int, default=15, help="niceness of the vLLM server (Ray workers run at 15)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"))
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 requests of 32 tokens at 8 streams")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.max_tokens = 16, [8], 32
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    use_local_stack()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, engine_cfg = small_model(work)
    adapter_dirs = register_adapters(model_dir, work)
    lora = from_dict(LoraServingConfig, LORA)
    lora_kwargs = lora.engine_kwargs()

    servers: dict = {}
    results: dict[str, list[LoadResult]] = {VLLM: [], OURS: [], BASE: []}
    busy: dict[str, list[int]] = {name: [] for name in results}
    rollout_s = None
    try:
        # The vLLM server: rayline's engine arguments and environment, plus the same LoRA arguments.
        flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in lora_kwargs.items()]
        vllm_args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
                     "rayline", "--disable-uvicorn-access-log", *vllm_cli_args(engine_cfg), *flags,
                     "--lora-modules", f"rayline:a={adapter_dirs[0]}"]
        env = {**os.environ, **eng.runtime_env(engine_cfg).get("env_vars", {})}
        servers[VLLM] = VllmServer(vllm_args, env, args.vllm_port, work / "vllm_lora_server.log", args.vllm_nice)
        pinned = {"a": {"ref": f"models:/{ADAPTER_MODEL}/1", "source": adapter_dirs[0], "name": ADAPTER_MODEL,
                        "version": "1", "label": f"{ADAPTER_MODEL}/1"}}
        app = RaylineApp(model_dir, engine_cfg, {"app_name": "rayline-bench-lora", "route_prefix": "/bench-lora", "lora": LORA}, adapters=pinned)
        servers[OURS] = servers[BASE] = app
        answer = wait_until_answering(app.url, "rayline:a", f"rayline:a@{ADAPTER_MODEL}/1", "hi", 120, field="model",
                                      api_key=admin_key(app.cfg))
        if not answer.ok:
            raise RuntimeError(f"the adapter does not answer: {answer.reason}")
        servers[VLLM].wait()
        models = {VLLM: "rayline:a", OURS: "rayline:a", BASE: "rayline"}
        for c in args.concurrency:
            runs: dict[str, list[LoadResult]] = {name: [] for name in results}
            for i, order in enumerate(round_order([VLLM, OURS, BASE], args.rounds)):
                for name in order:
                    result, threads = timed_load(servers[name], c, args, models[name])
                    runs[name].append(result)
                    busy[name] += [threads] if threads is not None else []
                    print(f"{c} streams, round {i + 1}: {name} {result}", flush=True)
            for name in results:
                results[name].append(combine(runs[name]))
        setups = {VLLM: {**servers[VLLM].setup(), **lora_setup(lora_kwargs), **busy_setup(busy[VLLM])},
                  OURS: {**app.setup(), **lora_setup(lora_kwargs), **busy_setup(busy[OURS])}}
        servers[VLLM].stop()
        if setups[VLLM]["max_num_batched_tokens"] == "not logged":
            sched = resolve_scheduler({VLLM: servers[VLLM].log_path}).get(VLLM, {})
            setups[VLLM].update({**sched, "max_num_batched_tokens from": "vLLM's EngineArgs on the server's logged args"})
        rollout_s = bench_adapter_rollout(app)
    finally:
        if VLLM in servers and servers[VLLM].proc.poll() is None:
            servers[VLLM].stop()
        if OURS in servers:
            servers[OURS].stop()

    print(f"\n{args.rounds} rounds per side and concurrency, A-B-C, C-B-A; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups({"rayline": setups[OURS], VLLM: setups[VLLM]})
    print(f"{'side':24} {'streams':>7} {'requests':>8} {'failed':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for label, rs in results.items():
        for r in rs:
            print(f"{label:24} {r.concurrency:7d} {r.requests:8d} {r.failed:6d} {r.tokens_per_s:8.1f} "
                  f"{r.ttft_p50:8.3f}s {r.ttft_p99:8.3f}s")
    print(f"adapter rollout time (alias set -> version 2 answering behind rayline:a, in place): {rollout_s:.1f}s")
    # The LoRA arguments are shown as given (vLLM logs no LoRA config to read them back from), not matched: the same
    # dict on both sides would match by construction, a check that cannot fail.
    must_match = MUST_MATCH
    ratios = {}
    for v, r, b in zip(results[VLLM], results[OURS], results[BASE]):
        ratios[(VLLM, v.concurrency)] = r.tokens_per_s / v.tokens_per_s
        ratios[(BASE, b.concurrency)] = r.tokens_per_s / b.tokens_per_s
        print(f"adapter vs base on rayline's one engine ({b.concurrency} streams; vLLM's LoRA cost): "
              f"{r.tokens_per_s / b.tokens_per_s:.2f}x")
        print(ratio_line(f"{VLLM} ({v.concurrency} streams)", r.tokens_per_s / v.tokens_per_s, setups[OURS],
                         setups[VLLM], must_match))
    return {"results": results, "setups": setups, "rollout_s": rollout_s, "ratios": ratios}


if __name__ == "__main__":
    main()
