"""Champion and challenger (issue 20): how fast a canary starts, whether any request fails, and what the split costs.

    python -m pipelines.stack up                 # the local stack (Ray head + MLflow), or export another stack's env
    python bench/bench_canary.py [--requests 96] [--concurrency 16] [--max-tokens 32] [--rounds 2]
    python bench/bench_canary.py --quick         # a smoke run: small loads

The `tiny` model, registered twice with the same weights (v1 champion, v2 challenger), both apps from one serving
config (fractional CPUs: both engines and the load share the 2-core box).
  1. The canary as a user runs it: `challenger` set on v2 under a steady loopback load of users, the real
     `Rollout` with steps [0.25, 0.5] of 10 s: alias set -> the first live answer signed by the challenger arriving
     at its client (target <= 60 s; the clock starts as the alias is set and stops when that answer is in), the
     whole canary (through the promotion of v2), and the failed client requests (target 0).
  2. What the split costs, on equal terms: the same apps, engines and load (streamed completions of exactly
     `--max-tokens` tokens, bench/serve_load.py), alternating rounds (A-B, B-A):
       a. the champion app with the canary on at share 0 (every request through the split's middleware, answered by
          the champion) vs the canary off: what the middleware costs every request of a canary;
       b. the champion app forwarding every request to the challenger (share 1.0) vs the same load sent straight to
          the challenger's own route: what the extra loopback hop costs the challenger's share.
     Each pair is answered by one engine, so a ratio away from 1.0x is the split's own cost. What must match is read
     back, not configured: the version that signed each answer (system_fingerprint), the engine of the app serving
     it (its replica's EngineCore and vLLM's logged settings) and the load each side completed.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_servers import EAGER, ENGINE, SERVE, replica_engine, use_local_stack  # noqa: E402
from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, answered_by, combine, run_load  # noqa: E402
from core import registry  # noqa: E402
from core.config import from_dict  # noqa: E402
from serve.online import engine as eng  # noqa: E402
from serve.online.app import render_serve_config, resolve_served_model  # noqa: E402
from serve.promotion.canary import Canary  # noqa: E402
from serve.promotion.outcome import DEPLOYED  # noqa: E402
from serve.promotion.rollout import Rollout  # noqa: E402
from serve.promotion.rollout_config import Config as RolloutConfig  # noqa: E402
from serve.online.serve_config import Config as ServeConfig  # noqa: E402
from serve.promotion.verify import smoke_request, wait_until_answering, wait_until_healthy  # noqa: E402
from serve.batch.tracking import record_figures  # noqa: E402

NAME = "rayline-bench-canary"
MUST_MATCH = ["answered by", "engine", "load"]


def user_load(url: str, stop: threading.Event, seen: list, failed: list, clients: int = 3) -> list[threading.Thread]:
    """Loopback clients as random users: (time sent, time answered, version that signed the answer) of each answer,
    each failure."""
    from openai import OpenAI

    client = OpenAI(base_url=url, max_retries=0, timeout=120)  # the key: $OPENAI_API_KEY, the stack's client key

    def run(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            t = time.time()
            try:
                r = client.chat.completions.create(model="rayline", max_tokens=6, user=f"u{rng.randrange(500)}",
                                                   messages=[{"role": "user", "content": "What is 2 + 3?"}])
                seen.append((t, time.time(), r.system_fingerprint))
            except Exception as e:  # counted: the target is none
                failed.append(f"{type(e).__name__}: {e}")
                time.sleep(0.5)
            time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.max_tokens, args.rounds = 24, 8, 16, 1
    use_local_stack()
    from stack.tiny_model import build_tiny_model

    work = ROOT / ".rayline" / "bench" / "canary"
    model_dir = work / "tiny"
    if not (model_dir / "model.safetensors").exists():
        build_tiny_model(model_dir, "tiny", seed=0)
    try:
        registry.client().delete_registered_model(NAME)
    except Exception:
        pass
    with registry.start_run("rayline-bench", "register-canary") as run:
        for _ in range(2):
            mv = registry.register_checkpoint(NAME, str(model_dir), run_id=run.info.run_id)
            record_figures(NAME, mv.version, {"exact_match": 1.0})  # the gate's evidence, as an eval job logs it
    engine = {**ENGINE, **EAGER, "max_model_len": 256, "max_num_seqs": 16, "kv_cache_memory_bytes": 64 * eng.MiB,
              "cpus_per_engine": 0.4, "model": f"models:/{NAME}@champion"}
    serve_cfg = from_dict(ServeConfig, {**SERVE, "app_name": "rayline-bench-canary", "route_prefix": "/bench-canary",
                                          "engine": engine})
    rollout = Rollout(from_dict(RolloutConfig, {
        "model": NAME, "triggered_by": "bench", "serve_config": "unused",
        "canary": {"steps": [0.25, 0.5], "step_s": 10, "min_requests": 3, "max_ttft_p50_ratio": 5.0,
                   "max_ttft_p99_ratio": 10.0, "max_itl_ratio": 5.0, "latency_slack_s": 0.2,
                   # judged on the stack's Prometheus (5 s scrapes, 2 s replica reports) when it runs one
                   "metrics_lag_s": 8}}), serve_cfg)
    canary = Canary(rollout)
    out: dict = {}
    try:
        registry.set_alias(NAME, "champion", "1")
        first = rollout.once()
        if first.status != DEPLOYED:
            raise RuntimeError(first.line())
        out.update(canary_run(rollout, serve_cfg.base_url()))
        out.update(split_cost(rollout, canary, args))
    finally:
        canary.target.delete()
        rollout.target.delete()
    print(f"\nchallenger set -> first live request answered by it: {out['first_request_s']:.1f} s (target <= 60 s); "
          f"whole canary {out['canary_s']:.1f} s; {out['requests']} requests, {out['failed']} failed (target 0)")
    for line in out["lines"]:
        print(line)
    return out


def canary_run(rollout: Rollout, url: str) -> dict:
    stop, seen, failed = threading.Event(), [], []
    threads = user_load(url, stop, seen, failed)
    time.sleep(3)
    set_at = time.time()
    registry.set_alias(NAME, "challenger", "2")
    result = rollout.once()
    stop.set()
    for t in threads:
        t.join(timeout=120)
    if result.status != DEPLOYED:
        raise RuntimeError(result.line())
    firsts = [done for _, done, fp in seen if fp == f"{NAME}/2"]
    return {"first_request_s": first_answer_s(set_at, firsts), "canary_s": result.seconds,
            "requests": len(seen), "failed": len(failed), "failures": failed[:5]}


def first_answer_s(set_at: float, answered_at: list[float]) -> float:
    """Seconds from the alias set to the first challenger answer in (nan: none came)."""
    return min(answered_at) - set_at if answered_at else float("nan")


def split_cost(rollout: Rollout, canary: Canary, args) -> dict:
    """Alternating rounds of each pair; the champion serves v2 now, the challenger app (v1) is deployed anew."""
    served = resolve_served_model(f"models:/{NAME}/1")
    start = time.time()
    canary.target.apply(render_serve_config(canary.serve_cfg, served))
    ok = wait_until_healthy(canary.target.state, served, 900, applied_at=start).ok and wait_until_answering(
        canary.base_url, "rayline", served.label, "hi", 120, api_key=rollout.admin_key).ok
    if not ok:
        raise RuntimeError("the challenger app did not come up")
    champion_url, challenger_url = rollout.base_url, canary.base_url
    canary._split(None)
    # Which app serves which version, read back: each app's own route answers with its engine's fingerprint.
    app_of = {smoke_request(url, "rayline", "hi", api_key=rollout.admin_key).get("system_fingerprint"): app
              for url, app in ((champion_url, rollout.serve_cfg.app_name), (challenger_url, canary.serve_cfg.app_name))}
    pairs = {
        "a": {"rayline": ("canary on, share 0", 0.0, champion_url, f"{NAME}/2"),
              "canary off": ("canary off", None, champion_url, f"{NAME}/2")},
        "b": {"rayline": ("forwarded to the challenger (share 1.0)", 1.0, champion_url, f"{NAME}/1"),
              "challenger direct": ("challenger's own route", None, challenger_url, f"{NAME}/1")},
    }
    lines = []
    for key, sides in pairs.items():
        results: dict[str, list[LoadResult]] = {name: [] for name in sides}
        for order in round_order(list(sides), args.rounds):
            for name in order:
                _, share, url, _ = sides[name]
                canary._split(share)
                results[name].append(run_load(url, args.concurrency, args.requests, args.max_tokens))
        canary._split(None)
        pooled = {name: combine(rs) for name, rs in results.items()}
        setups = {name: {"side": what, "URL": url, "canary share": "off" if share is None else share,
                         **read_back(pooled[name], app_of, expected)}
                  for name, (what, share, url, expected) in sides.items()}
        print_setups(setups, f"comparison {key}")
        for name, r in pooled.items():
            print(f"  {name}: {r.tokens_per_s:,.1f} tok/s, TTFT p50 {r.ttft_p50 * 1000:.0f} ms, "
                  f"p99 {r.ttft_p99 * 1000:.0f} ms, {r.failed} failed")
        ours, (base_name, base) = pooled["rayline"], [(n, r) for n, r in pooled.items() if n != "rayline"][0]
        lines.append(ratio_line(f"{base_name} (throughput)", ours.tokens_per_s / base.tokens_per_s,
                                setups["rayline"], setups[base_name], MUST_MATCH))
        lines.append(ratio_line(f"{base_name} (TTFT p50, lower is better)", ours.ttft_p50 / base.ttft_p50,
                                setups["rayline"], setups[base_name], MUST_MATCH))
    return {"lines": lines}


def read_back(result: LoadResult, app_of: dict, expected: str) -> dict:
    """A side's must-match set-up from what ran: the versions that signed its answers, the engine of the app that
    serves the one version (none when several or an unexpected one answered: the side did not do the work it
    names), and the load its clients completed."""
    versions = set(result.answered_by)
    app = app_of.get(expected) if versions == {expected} else None
    return {"answered by": answered_by(result),
            "engine": replica_engine(app) if app else f"not read back: answered by {sorted(versions)}",
            "load": f"{result.requests - result.failed} of {result.requests} requests answered, "
                    f"{result.tokens} output tokens, {result.concurrency} clients"}


if __name__ == "__main__":
    main()
