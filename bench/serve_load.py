"""The load bench_serve.py puts on each server: `--requests` streamed completions of exactly `max_tokens`
output tokens (ignore_eos) from `concurrency` clients over loopback HTTP, timed by the client's own clock:
output tokens/s over the whole load, time to first token per request (p50/p99), failures counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from pipelines.sample_corpus import WORDS


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


async def _one(client, url: str, prompt: str, max_tokens: int, model: str) -> tuple[float, int]:
    """One streamed completion -> (time to first token, output tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
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


async def _load(url: str, concurrency: int, requests: int, max_tokens: int, model: str) -> LoadResult:
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
                    ttft, n = await _one(client, url, prompt, max_tokens, model)
                    ttfts.append(ttft)
                    tokens.append(n)
                except Exception:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LoadResult(concurrency, requests, sum(tokens) / wall, percentile(ttfts, 0.5), percentile(ttfts, 0.99), failed,
                      ttfts, sum(tokens), wall)


def run_load(url: str, concurrency: int, requests: int, max_tokens: int, model: str = "rayline") -> LoadResult:
    """`model`: what the requests name (`rayline`, or a served LoRA adapter such as `rayline:a`)."""
    asyncio.run(_load(url, min(4, concurrency), min(8, requests), 16, model))  # warm-up: connections, caches
    return asyncio.run(_load(url, concurrency, requests, max_tokens, model))
