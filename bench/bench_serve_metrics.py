"""The cost of rayline's own serving metrics: the same Serve app twice on the local stack, request metrics on and off.

    python -m pipelines.stack up
    python bench/bench_serve_metrics.py [--requests 128] [--concurrency 32 64] [--max-tokens 128] [--rounds 2] [--passes 2]

Both apps serve the same `small` model with the same engine (bench/serve_servers.py's ENGINE and SERVE, its own
name and route for the second), differing only in `request_metrics` (rayline_serve_requests_total, counted per
response by serve/online/llm_hooks.py's middleware; the engine's own metrics are on in both). Each gets `--requests`
streamed completions per concurrency, in alternating rounds (A-B, B-A); then both are redeployed with their
slots swapped (the first app takes `/`, the second `/b`) and loaded again, and both passes pool. Each side's
effective set-up is read back and printed, and the last lines are `rayline vs rayline without request metrics (N streams): <ratio>x`
(target >= 0.98x; above 1.0x means the two app slots differ, not that metrics are free).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_servers import (  # noqa: E402
    MUST_MATCH, RaylineApp, busy_setup, small_model, timed_load, use_local_stack,
)
from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, combine  # noqa: E402
from serve.online import engine as eng  # noqa: E402

METRICS_ON, METRICS_OFF = "rayline", "rayline without request metrics"


# The two app slots: the first deployed takes SERVE's name and route; the second its own.
SLOTS = ({}, {"app_name": "rayline-bench-b", "route_prefix": "/bench-b"})


def compare(args, model_dir: Path, engine_cfg: eng.EngineConfig) -> dict:
    """Both variants deployed side by side and loaded in alternating rounds; then redeployed with the slots
    swapped and loaded again, so neither variant keeps the slot that runs first or on `/bench`. Both passes pool."""
    results: dict[str, list[LoadResult]] = {METRICS_ON: [], METRICS_OFF: []}
    runs: dict[str, dict[int, list[LoadResult]]] = {name: {c: [] for c in args.concurrency} for name in results}
    busy: dict[str, list[int]] = {name: [] for name in results}
    setups: dict[str, list[dict]] = {name: [] for name in results}
    for swap in range(args.passes):
        order = [METRICS_ON, METRICS_OFF][::-1 if swap % 2 else 1]
        servers: dict = {}
        try:
            for name, slot in zip(order, SLOTS):
                servers[name] = RaylineApp(model_dir, engine_cfg, {**slot, "request_metrics": name == METRICS_ON})
                print(f"pass {swap + 1}: {name} on {servers[name].url}", flush=True)
            for c in args.concurrency:
                for i, names in enumerate(round_order(list(results), args.rounds)):
                    for name in names:
                        result, threads = timed_load(servers[name], c, args)
                        runs[name][c].append(result)
                        busy[name] += [threads] if threads is not None else []
                        print(f"pass {swap + 1}, {c} streams, round {i + 1}: {name} {result}", flush=True)
            for name, server in servers.items():
                setups[name].append({**server.setup(), "request_metrics": str(server.cfg.request_metrics)})
        finally:
            for server in servers.values():
                server.stop()
    for name in results:
        results[name] = [combine(runs[name][c]) for c in args.concurrency]
    # The set-up of each pass, read back; a key that changed between passes shows both values.
    merged = {name: {k: " / ".join(dict.fromkeys(str(s.get(k)) for s in per_pass))
                     for k in dict.fromkeys(k for s in per_pass for k in s)} for name, per_pass in setups.items()}
    merged = {name: {**m, **busy_setup(busy[name])} for name, m in merged.items()}
    print(f"\n{args.passes} passes (slots swapped) x {args.rounds} rounds per app and concurrency, A-B, B-A; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups(merged)
    ratios = {}
    for on, off in zip(results[METRICS_ON], results[METRICS_OFF]):
        print(f"{on.concurrency} streams: request metrics on {on}; off {off}")
    for on, off in zip(results[METRICS_ON], results[METRICS_OFF]):
        ratios[on.concurrency] = on.tokens_per_s / off.tokens_per_s
        print(ratio_line(f"rayline without request metrics ({on.concurrency} streams)", ratios[on.concurrency],
                         merged[METRICS_ON], merged[METRICS_OFF], MUST_MATCH))
    return {"results": results, "setups": merged, "ratios": ratios}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="load runs per app, concurrency and pass: A-B, B-A, ...")
    p.add_argument("--passes", type=int, default=2, help="deployments, the variants' slots swapped each time")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"), help="where the model goes")
    args = p.parse_args(argv)
    use_local_stack()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return compare(args, *small_model(work))


if __name__ == "__main__":
    main()
