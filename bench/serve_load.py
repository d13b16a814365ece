"""The load bench_serve.py puts on each server: `--requests` streamed completions of exactly `max_tokens`
output tokens (ignore_eos) from `concurrency` clients over loopback HTTP, timed by the client's own clock:
output tokens/s over the whole load, time to first token per request (p50/p99), failures counted.

With every request the same length, the streams end on the same engine step and the next `concurrency` requests
arrive together, into an idle engine: the load runs in waves, and TTFT measures how a burst of arrivals meets the
engine's steps. `spread` > 0 draws each request's length from max_tokens x [1 - spread, 1 + spread] instead (the
same seeded lengths for every server), so the streams fall out of step and TTFT is measured under a steady flow:
from each client's second request on (`timed_ttfts`). Every client's first request starts at once, a burst like
the lockstep load's waves, and counting it would make a run of 2 requests per client half burst; it still counts
in the throughput.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

from stack.sample_corpus import WORDS


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
    answered_by: dict[str, int] = field(default_factory=dict, repr=False)
    """How many answers each `system_fingerprint` signed (the serving version, read back from the responses)."""


def combine(results: list[LoadResult]) -> LoadResult:
    """Several rounds of one server at one concurrency as one result: tokens over time, TTFTs pooled."""
    ttfts = [t for r in results for t in r.ttfts]
    tokens, wall = sum(r.tokens for r in results), sum(r.wall_s for r in results)
    answered: dict[str, int] = {}
    for r in results:
        for fp, n in r.answered_by.items():
            answered[fp] = answered.get(fp, 0) + n
    return LoadResult(results[0].concurrency, sum(r.requests for r in results), tokens / wall,
                      percentile(ttfts, 0.5), percentile(ttfts, 0.99), sum(r.failed for r in results), ttfts, tokens, wall,
                      answered)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


MIN_TAIL_SAMPLES = 500
"""TTFTs a p99 is read from before it is a figure: with fewer, it is one of the 5 slowest, and one slow request moves
it (2026-12-06: 1.32x and 1.08x at 64 streams, 15 minutes apart, on 256 and 768 samples)."""


def tail_note(result: LoadResult, rounds: int, spread: float, label: str, min_samples: int = MIN_TAIL_SAMPLES) -> str | None:
    """A line saying a pooled TTFT p99 rests on too few samples, with the --requests that would give enough; None when
    there are min_samples or more. A round times every request in lockstep (spread 0), and under a steady flow every
    request after each client's first (timed_ttfts)."""
    n = len(result.ttfts)
    if n >= min_samples:
        return None
    rank = n - int(round(0.99 * (n - 1)))
    untimed = result.concurrency if spread else 0
    enough = -(-min_samples // rounds) + untimed
    which = "the slowest" if rank == 1 else f"the {rank}{ {2: 'nd', 3: 'rd'}.get(rank, 'th')}-slowest"
    return (f"note: TTFT p99 of {label} at {result.concurrency} streams is {which} of {n} samples: "
            f"one slow request moves it; --requests {enough} gives {min_samples} or more")


async def _one(client, url: str, prompt: str, max_tokens: int, model: str) -> tuple[float, int, str]:
    """One streamed completion -> (time to first token, output tokens, the system_fingerprint of its last chunk:
    vLLM signs the usage chunk with it; "none" when the server gave none)."""
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
    final = json.loads(last[len("data: "):])
    usage = final.get("usage") or {}
    return ttft or float("nan"), int(usage.get("completion_tokens", 0)), final.get("system_fingerprint") or "none"


def lengths(requests: int, max_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """Each request's output length: all `max_tokens` (spread 0), or drawn uniformly from max_tokens x
    [1 - spread, 1 + spread], seeded, so every server gets the same list."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    if spread == 0.0:
        return [max_tokens] * requests
    rng = random.Random(seed)
    low, high = round(max_tokens * (1 - spread)), round(max_tokens * (1 + spread))
    return [max(1, rng.randint(low, high)) for _ in range(requests)]


def timed_ttfts(samples: list[tuple[int, float]], spread: float) -> list[float]:
    """The TTFTs a load reports, from (the request's place among its client's requests, 0 first; TTFT): all of them
    in lockstep (spread 0, where every wave is a burst), or under a steady flow only those after each client's first
    request (the opening burst left out)."""
    return [ttft for nth, ttft in samples if not spread or nth > 0]


async def _load(url: str, concurrency: int, requests: int, max_tokens: int, model: str,
                spread: float = 0.0, api_key: str = "") -> LoadResult:
    import httpx

    prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(32)) for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in zip(prompts, lengths(requests, max_tokens, spread)):
        queue.put_nowait(item)
    samples, tokens, failed, answered = [], [], 0, {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        async def worker():
            nonlocal failed
            nth = 0
            while not queue.empty():
                prompt, length = queue.get_nowait()
                try:
                    ttft, n, fp = await _one(client, url, prompt, length, model)
                    samples.append((nth, ttft))
                    tokens.append(n)
                    answered[fp] = answered.get(fp, 0) + 1
                except Exception:
                    failed += 1
                nth += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = timed_ttfts(samples, spread)
    return LoadResult(concurrency, requests, sum(tokens) / wall, percentile(ttfts, 0.5), percentile(ttfts, 0.99), failed,
                      ttfts, sum(tokens), wall, answered)


def answered_by(result: LoadResult) -> str:
    """Who answered a load, read back from the responses: `name/N x96`, several joined by `, `."""
    return ", ".join(f"{fp} x{n}" for fp, n in sorted(result.answered_by.items())) or "no answers"


def run_load(url: str, concurrency: int, requests: int, max_tokens: int, model: str = "rayline",
             spread: float = 0.0, api_key: str | None = None) -> LoadResult:
    """`model`: what the requests name (`rayline`, or a served LoRA adapter such as `rayline:a`); `spread`: see
    the module docstring; `api_key`: sent as a Bearer token, None = $OPENAI_API_KEY (the stack's client key, as the
    `openai` SDK reads it; serve_servers.VllmServer gives the vLLM server the same key, so both sides check one)."""
    key = os.environ.get("OPENAI_API_KEY", "") if api_key is None else api_key
    asyncio.run(_load(url, min(4, concurrency), min(8, requests), 16, model, api_key=key))  # warm-up: connections
    return asyncio.run(_load(url, concurrency, requests, max_tokens, model, spread, key))
