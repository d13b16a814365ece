"""Prefix-aware routing (issue 50 section 3): Ray Serve LLM's prefix-cache-affinity router against Serve's default power
of two, two engine replicas, under chat loads with and without long shared system prompts.

    python -m pipelines.stack up --nodes 2       # two 1-CPU worker nodes: one engine replica on each
    python bench/bench_routing.py [--requests 480] [--concurrency 16] [--system-prompts 96] [--system-words 300]
                                  [--kv-cache-mib 128] [--max-tokens 32] [--rounds 2]

Two apps of the `small` model (bench/serve_servers.py), each `ingress: deployment` with two engine replicas on the
same two worker nodes (one replica a node), deployed one at a time in alternating rounds (A-B, B-A): each round
deploys a side afresh (cold caches on both sides), runs both loads on it and deletes it:
  prefix  routing.policy prefix_cache_affinity (serve/online/routing_config.py)
  p2c     routing.policy power_of_two (Serve's default)
Two loads, the same seeded requests for both apps: `shared`: each chat opens with one of --system-prompts long system
prompts (--system-words words) and asks a short question; `unique`: each chat's system prompt is its own. The shared
prompts are sized to need more KV cache than one replica has (--kv-cache-mib on both sides; the set-up prints the
tokens each prompt and the cache hold) and less than two have: under power of two every replica sees every prompt
and evicts them, under affinity each keeps its half. Streamed chat completions of exactly --max-tokens tokens;
reported: TTFT p50/p99 and output tokens/s over the rounds. Each side's router is read back from the running
deployment (Serve's REST API), its engines' settings from a replica. The last lines: `rayline vs p2c` TTFT p50
(lower is better) and throughput, per load. Targets: TTFT p50 >= 1.3x lower with shared prompts; no throughput loss
without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, combine, percentile  # noqa: E402
from bench.serve_servers import RaylineApp, replica_engine, small_model, use_local_stack  # noqa: E402
from core.node_labels import NODE_LABEL  # noqa: E402
from stack.sample_corpus import WORDS  # noqa: E402
from serve.online.app import engine_deployment_name  # noqa: E402

# Each app's two replicas on the same two worker nodes (1-CPU nodes, 1-CPU engines: one replica a node), one app at a
# time, so both sides run the same placement with nothing else on those nodes; the router is all that differs.
WORKERS = ["worker-1", "worker-2"]
ON_WORKERS = {NODE_LABEL: f"in({','.join(WORKERS)})"}
SIDES = {"prefix": {"app_name": "rayline-bench-prefix", "route_prefix": "/bench-prefix",
                    "routing": {"policy": "prefix_cache_affinity"}, "node_labels": ON_WORKERS},
         "p2c": {"app_name": "rayline-bench-p2c", "route_prefix": "/bench-p2c", "routing": {"policy": "power_of_two"},
                 "node_labels": ON_WORKERS}}
TWO_REPLICAS = {"ingress": "deployment", "autoscaling": {"min_replicas": 2, "max_replicas": 2},
                "ingress_cpus": 0.1, "stream_batching_interval_ms": 0.0}
MUST_MATCH = ["engine replicas", "engine", "load"]


def require_workers(labels: list[str]) -> None:
    """Exit with one line unless the local stack has these worker nodes (their `rayline.io/node` labels)."""
    from stack import lifecycle as stack

    found = stack.node_ids(stack.load_stack_config(None, []))
    missing = [label for label in labels if label not in found]
    if missing:
        raise SystemExit(f"the stack lacks worker nodes {', '.join(missing)}: `python -m pipelines.stack up --nodes "
                         f"{len(labels)}` (one engine replica per 1-CPU node, two per app)")


def chats(n: int, prompts: int, words: int, shared: bool, seed: int = 0) -> list[list[dict]]:
    """`n` chats: a long system prompt (one of `prompts`, or each its own) and a short question, seeded."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        r = random.Random(k)
        return " ".join(r.choice(WORDS) for _ in range(words))

    out = []
    for i in range(n):
        system = text(rng.randrange(prompts) if shared else 10_000 + i)
        question = " ".join(rng.choice(WORDS) for _ in range(8)) + "?"
        out.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return out


async def _chat_load(url: str, key: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> LoadResult:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    ttfts, tokens, failed = [], [], 0
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            nonlocal failed
            while not queue.empty():
                body = {"model": "rayline", "messages": queue.get_nowait(), "max_tokens": max_tokens, "stream": True,
                        "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
                start, first, last = time.perf_counter(), None, ""
                try:
                    async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
                        r.raise_for_status()
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                first = first or time.perf_counter() - start
                                last = line
                    ttfts.append(first or float("nan"))
                    tokens.append(int((json.loads(last[6:]).get("usage") or {}).get("completion_tokens", 0)))
                except Exception:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LoadResult(concurrency, len(requests), sum(tokens) / wall, percentile(ttfts, 0.5), percentile(ttfts, 0.99),
                      failed, ttfts, sum(tokens), wall)


def prompt_sizes(model_dir: Path, shared: list[list[dict]], engine_cfg) -> str:
    """How many tokens the shared system prompts take against one engine's KV cache (the model's own config and
    tokenizer: layers x KV heads x head size x 2 (K and V) x the dtype's bytes a token)."""
    from transformers import AutoConfig, AutoTokenizer

    from serve.online.precision import resolve_dtype

    tok, config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    prompts = {m[0]["content"] for m in shared}
    tokens = [len(tok(tok.apply_chat_template([{"role": "system", "content": p}], tokenize=False))["input_ids"])
              for p in prompts]
    head = config.hidden_size // config.num_attention_heads
    dtype_bytes = 2 if resolve_dtype(engine_cfg.dtype, engine_cfg.accelerator) in ("bfloat16", "float16") else 4
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head * dtype_bytes
    cache = engine_cfg.kv_cache_memory_bytes // per_token
    return (f"{len(prompts)} prompts of {min(tokens)}-{max(tokens)} tokens, {sum(tokens):,} in all; KV cache "
            f"{cache:,} tokens an engine ({engine_cfg.kv_cache_memory_bytes // 1024**2} MiB)")


def read_back(app: RaylineApp, result: LoadResult) -> dict:
    """The side's router and replicas from the running deployment, its engine from a replica, the load completed."""
    deployment = engine_deployment_name(app.cfg)
    details = app.target._details()["applications"][app.cfg.app_name]["deployments"][deployment]
    router = (details.get("deployment_config") or {}).get("request_router_config") or {}
    running = [r for r in details.get("replicas") or [] if r.get("state") == "RUNNING"]
    return {"router": str(router.get("request_router_class", "not read back")).rsplit(".", 1)[-1],
            "engine replicas": f"{len(running)} RUNNING on {len({r.get('node_id') for r in running})} node(s)",
            "engine": replica_engine(app.cfg.app_name).split(": ", 1)[-1],
            "load": f"{result.requests - result.failed} of {result.requests} answered, {result.tokens} output tokens"}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--system-prompts", type=int, default=96)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--kv-cache-mib", type=int, default=128, help="each engine's KV cache (both sides)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"))
    args = p.parse_args(argv)
    use_local_stack()
    require_workers(WORKERS)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, engine_cfg = small_model(work)
    # A whole worker node a replica; a KV cache that holds about half the shared prompts.
    engine_cfg = replace(engine_cfg, cpus_per_engine=1.0, kv_cache_memory_bytes=args.kv_cache_mib * 1024**2)
    key = os.environ.get("OPENAI_API_KEY", "")
    loads = {name: chats(args.requests, args.system_prompts, args.system_words, name == "shared")
             for name in ("shared", "unique")}
    sizes = prompt_sizes(model_dir, loads["shared"], engine_cfg)
    print(f"shared load: {sizes}", flush=True)
    runs = {(side, load): [] for side in SIDES for load in loads}
    setups: dict[tuple[str, str], dict] = {}
    for i, order in enumerate(round_order(list(SIDES), args.rounds)):
        for side in order:
            app = RaylineApp(model_dir, engine_cfg, {**TWO_REPLICAS, **SIDES[side]})
            try:
                for load, requests in loads.items():
                    r = asyncio.run(_chat_load(app.url, key, requests, args.concurrency, args.max_tokens))
                    runs[(side, load)].append(r)
                    print(f"round {i + 1}, {load} prompts: {side} {r}", flush=True)
                    setups[(side, load)] = read_back(app, r)
            finally:
                app.stop()
    pooled = {k: combine(v) for k, v in runs.items()}
    for (side, load), setup in setups.items():
        setup["load"] = (f"{sum(r.requests - r.failed for r in runs[(side, load)])} of "
                         f"{sum(r.requests for r in runs[(side, load)])} answered, {pooled[(side, load)].tokens} output tokens")
    print(f"\n{args.rounds} rounds per app and load, A-B, B-A; {args.requests} chats of {args.max_tokens} tokens from "
          f"{args.concurrency} clients; system prompts of {args.system_words} words, {args.system_prompts} shared or "
          f"each its own ({sizes}); {time.strftime('%Y-%m-%d %H:%M:%S')}; load average {os.getloadavg()[0]:.1f}")
    lines = []
    for load in loads:
        print_setups({f"{side} ({load})": setups[(side, load)] for side in SIDES}, f"{load} prompts")
        ours, base = pooled[("prefix", load)], pooled[("p2c", load)]
        print(f"  prefix: {ours}\n  p2c:    {base}")
        lines.append(ratio_line(f"p2c, {load} prompts (TTFT p50, lower is better)", ours.ttft_p50 / base.ttft_p50,
                                setups[("prefix", load)], setups[("p2c", load)], MUST_MATCH))
        lines.append(ratio_line(f"p2c, {load} prompts (throughput)", ours.tokens_per_s / base.tokens_per_s,
                                setups[("prefix", load)], setups[("p2c", load)], MUST_MATCH))
    for line in lines:
        print(line)
    return {"pooled": pooled, "setups": setups}


if __name__ == "__main__":
    main()
