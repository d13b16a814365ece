"""The cost of rayline's own serving metrics: the same Serve app twice on the local stack, request metrics on and off.

    python -m pipelines.stack up
    python bench/bench_serve_metrics.py [--requests 128] [--concurrency 32 64] [--max-tokens 128] [--rounds 4]

Both apps serve the same `small` model with the same engine (bench/bench_serve.py's ENGINE and SERVE, its own
name and route for the second), differing only in `request_metrics` (rayline_serve_requests_total, counted per
response by serve/llm_hooks.py's middleware; the engine's own metrics are on in both). Each gets `--requests`
streamed completions per concurrency, in alternating rounds (A-B, B-A); each side's effective set-up is read
back and printed, and the last lines are `rayline vs rayline without request metrics (N streams): <ratio>x`
(target >= 0.98x; above 1.0x means the two app slots differ, not that metrics are free).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serve import (  # noqa: E402
    MUST_MATCH, RaylineApp, busy_setup, small_model, timed_load, use_local_stack,
)
from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, combine  # noqa: E402
from serve import engine as eng  # noqa: E402

METRICS_ON, METRICS_OFF = "rayline", "rayline without request metrics"


def compare(args, model_dir: Path, engine_cfg: eng.EngineConfig) -> dict:
    """The same app twice (own name and route), request metrics on and off, loaded in alternating rounds."""
    servers: dict = {}
    results: dict[str, list[LoadResult]] = {METRICS_ON: [], METRICS_OFF: []}
    busy: dict[str, list[int]] = {name: [] for name in results}
    try:
        servers[METRICS_ON] = RaylineApp(model_dir, engine_cfg)
        servers[METRICS_OFF] = RaylineApp(model_dir, engine_cfg, {
            "app_name": "rayline-bench-nometrics", "route_prefix": "/nometrics", "request_metrics": False})
        for c in args.concurrency:
            runs: dict[str, list[LoadResult]] = {name: [] for name in results}
            for i, order in enumerate(round_order(list(results), args.rounds)):
                for name in order:
                    result, threads = timed_load(servers[name], c, args)
                    runs[name].append(result)
                    busy[name] += [threads] if threads is not None else []
                    print(f"{c} streams, round {i + 1}: {name} {result}", flush=True)
            for name in results:
                results[name].append(combine(runs[name]))
        setups = {name: {**server.setup(), **busy_setup(busy[name]), "request_metrics": str(server.cfg.request_metrics)}
                  for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{args.rounds} rounds per app and concurrency, A-B, B-A; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups(setups)
    ratios = {}
    for on, off in zip(results[METRICS_ON], results[METRICS_OFF]):
        print(f"{on.concurrency} streams: request metrics on {on}; off {off}")
    for on, off in zip(results[METRICS_ON], results[METRICS_OFF]):
        ratios[on.concurrency] = on.tokens_per_s / off.tokens_per_s
        print(ratio_line(f"rayline without request metrics ({on.concurrency} streams)", ratios[on.concurrency],
                         setups[METRICS_ON], setups[METRICS_OFF], MUST_MATCH))
    return {"results": results, "setups": setups, "ratios": ratios}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="load runs per app and concurrency, A-B, B-A, ...")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"), help="where the model goes")
    args = p.parse_args(argv)
    use_local_stack()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return compare(args, *small_model(work))


if __name__ == "__main__":
    main()
