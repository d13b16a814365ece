"""Serving: rayline's Ray Serve LLM app vs vLLM's own OpenAI server, same `small` model, same engine, same load.

    python -m pipelines.stack up                 # the local stack (Ray head + MLflow), or export another stack's env
    python bench/bench_serve.py [--requests 256] [--concurrency 32 64] [--max-tokens 128] [--spread 0.25]
                                [--skip-rollout | --rollout-only] [--rollout-rounds N] [--rollout-compiled]
    python bench/bench_serve.py --quick          # a smoke run: small loads, no rollout

Each server gets `--requests` streamed completions of exactly `--max-tokens` output tokens
(ignore_eos; `--spread`: lengths drawn around it, see bench/serve_load.py) from `--concurrency` concurrent
clients on loopback, `--rounds` times in alternating order
(A-B-C, C-B-A: the machine's speed drifts; the `vllm defaults` server in the first round only); reported
over all rounds: output tokens/s and time to first token p50/p99. The servers:
  vllm server    `python -m vllm.entrypoints.openai.api_server` with the engine arguments and the engine
                 environment (`serve.online.engine.runtime_env`) rayline's serving config gives its engine, so only
                 the serving path differs. Without that environment vLLM on CPU turns the `uni` executor
                 into `mp` (a third process, busy-polling shared memory) and the work is not the same.
  vllm defaults  the same server as `vllm serve MODEL` runs it, with vLLM's own defaults: only the KV cache
                 size (vLLM's CPU default takes most of the RAM), the names and the port are given. Not equal
                 terms; a reference point.
  rayline        the Serve LLM app on the local stack, with the same engine config.
Each side's effective set-up is read back from its running processes and from what its engine logged,
and printed (bench/equal_terms.py). Then the rollout time of the `tiny` model (alias set -> new version
answering) is measured with the real rollout, under 3 loopback clients of short chats (bench_canary.user_load): what
the roll costs them (answers/s before and during, failed requests) and where its seconds went are printed. The last lines are the throughput ratios, one per
comparison; rayline vs vllm server only when the set-ups agree on MUST_MATCH.
The cost of rayline's own serving metrics is bench/bench_serve_metrics.py.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_canary import user_load  # noqa: E402
from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from bench.serve_load import LoadResult, combine, tail_note  # noqa: E402
from bench.serve_servers import (  # noqa: E402
    EAGER, ENGINE, MUST_MATCH, SERVE, RaylineApp, VllmServer, busy_setup, cpu_seconds, small_model, timed_load,
    use_local_stack,
)
from bench.serve_setup import resolve_scheduler  # noqa: E402
from core.config import from_dict  # noqa: E402
from serve.online import engine as eng  # noqa: E402
from serve.online.serve_config import Config as ServeConfig  # noqa: E402
from serve.batch.tracking import record_figures  # noqa: E402

VLLM = "vllm server"
DEFAULTS = "vllm serve, its own defaults (not equal terms)"


def bench_rollout(work: Path, rounds: int = 1, compiled: bool = False) -> float:
    """Seconds from setting the alias to the new version answering, with the tiny model and the real rollout: the
    median of `rounds` rollouts, each to the other version (v2, v1, v2, ...). The engine is eager, as
    configs/serve/tiny_cpu.yaml's; `compiled`: as the serving default's (ENGINE), to see what compiling costs a roll."""
    from core import registry
    from stack.tiny_model import build_tiny_model
    from serve.promotion.outcome import DEPLOYED
    from serve.promotion.rollout import Rollout
    from serve.promotion.rollout_config import Config as RolloutConfig

    name = "rayline-bench-tiny"
    dirs = [build_tiny_model(work / f"tiny-{s}", "tiny", seed=s) for s in (0, 1)]
    try:
        registry.client().delete_registered_model(name)
    except Exception:
        pass
    with registry.start_run("rayline-bench", "register-tiny") as run:
        versions = [registry.register_checkpoint(name, str(d), run_id=run.info.run_id).version for d in dirs]
    for v in versions:
        record_figures(name, v, {"exact_match": 1.0})  # the gate's evidence, as an eval job logs it
    # float32, as configs/serve/tiny_cpu.yaml: the tiny model in bfloat16 died in a replica (SIGILL, vLLM's AMX attention).
    tiny_engine = {**ENGINE, **({} if compiled else EAGER), "dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory_bytes": 64 * eng.MiB,
                   "cpus_per_engine": 0.5, "model": f"models:/{name}@champion"}
    serve_cfg = from_dict(ServeConfig, {**SERVE, "app_name": "rayline-bench-rollout", "route_prefix": "/bench-rollout",
                                          "engine": tiny_engine})
    rollout = Rollout(RolloutConfig(model=name, triggered_by="bench"), serve_cfg)
    try:
        registry.set_alias(name, "champion", versions[0])
        first = rollout.once()
        if first.status != DEPLOYED:
            raise RuntimeError(first.line())
        # Users on the app while it rolls: what the roll costs them (two engines share the cores for a while).
        times = []
        for i in range(rounds):
            stop, seen, failed = threading.Event(), [], []
            clients = user_load(serve_cfg.base_url(), stop, seen, failed)
            time.sleep(10)
            start = time.time()
            registry.set_alias(name, "champion", versions[(i + 1) % 2])
            second = rollout.once()
            took = time.time() - start
            time.sleep(5)
            stop.set()
            for t in clients:
                t.join(timeout=120)
            if second.status != DEPLOYED:
                raise RuntimeError(second.line())
            print(f"rollout round {i + 1} of {rounds}: " + roll_cost(seen, failed, start, took, len(clients)), flush=True)
            print(rollout_breakdown(second.run_id, serve_cfg.app_name, took), flush=True)
            times.append(took)
        print("rollout times: " + ", ".join(f"{t:.1f}s" for t in times), flush=True)
        return statistics.median(times)
    finally:
        rollout.target.delete()


def roll_cost(seen: list, failed: list, start: float, took: float, clients: int) -> str:
    """Short chat answers per second before the roll and during it, and the failed requests (bench_canary.user_load's
    (sent, answered, version) records)."""
    before = [a for sent, a, _ in seen if a < start and sent >= start - 8]  # the 8 s before, the warm-up left out
    during = [a for _, a, _ in seen if start <= a <= start + took]
    return (f"during the roll ({clients} clients of 6-token chats): {len(during)} answered, {len(failed)} failed "
            f"(target 0); answers/s {len(before) / 8:.1f} in the 8 s before, {len(during) / took:.1f} during"
            + (f"; first failures: {failed[:3]}" if failed else ""))


# What vLLM logs of its start, in the new replica's log: the lines that time its parts.
ENGINE_START_LINES = ("Loading weights took", "Model loading took", "init engine", "Starting to load model",
                      "Available KV cache memory", "Application startup complete")


def rollout_breakdown(run_id: str, app_name: str, total_s: float) -> str:
    """Where a rollout's seconds went: the rollout's own phases as it logged them to its MLflow run
    (`rollout/seconds_<phase>`, serve/promotion/rollout_phases.py; a run without them: gate, deploy = apply -> the new
    replica healthy, verify = healthy -> the new version answering) and what the new replica's vLLM logged of its
    start (weights, engine init), read from that replica's log."""
    from core import registry
    from serve.promotion.rollout_phases import phases_of

    from bench.serve_servers import engine_replica_pid

    m = registry.client().get_run(run_id).data.metrics
    phases = ", ".join(f"{k} {s:.1f}s" for k, s in phases_of(m).items()) or ", ".join(
        f"{k} {m[k]:.1f}s" for k in ("gate_s", "deploy_s", "verify_s", "switch_s") if k in m)
    lines = [f"rollout breakdown (alias set -> answering {total_s:.1f}s; the run's duration_s "
             f"{m.get('duration_s', float('nan')):.1f}s): {phases}"]
    replica = engine_replica_pid(app_name)
    if replica is not None:
        import os

        for fd in (1, 2):
            log = Path(os.readlink(f"/proc/{replica}/fd/{fd}"))
            lines += [f"  replica {replica}: {ln.strip()[:200]}" for ln in log.read_text(errors="replace").splitlines()
                      if any(k in ln for k in ENGINE_START_LINES)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--spread", type=float, default=0.0,
                   help="each request's length drawn from max-tokens x [1 - spread, 1 + spread], the same seeded "
                        "lengths for every server (0: all the same length, so the streams run in waves); > 0: "
                        "TTFT from each client's second request on (bench/serve_load.py)")
    p.add_argument("--vllm-port", type=int, default=8199, help="the vllm server's port; its own-defaults twin's is +1")
    p.add_argument("--vllm-nice", type=int, default=15, help="niceness of the vLLM servers (Ray workers run at 15)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rayline" / "bench"),
                   help="where the models and the vLLM server log go")
    p.add_argument("--rounds", type=int, default=2,
                   help="load runs per server and concurrency, in A-B-C, C-B-A order (the machine's speed drifts)")
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--rollout-only", action="store_true", help="only the rollout time (no load, no vLLM server)")
    p.add_argument("--rollout-compiled", action="store_true",
                   help="the rollout's engine compiled (the serving default) instead of eager (configs/serve/tiny_cpu.yaml)")
    p.add_argument("--rollout-rounds", type=int, default=1,
                   help="rollouts timed, each to the other version (the figure: their median)")
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
        rollout_s = bench_rollout(work, args.rollout_rounds, args.rollout_compiled)
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
                    result, threads = timed_load(servers[name], c, args, spread=args.spread)
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
    rollout_s, rollout_error = None, ""
    if not args.skip_rollout:
        try:
            rollout_s = bench_rollout(work, args.rollout_rounds, args.rollout_compiled)
        except RuntimeError as e:  # a failed rollout is a figure too; the load's figures above still stand
            rollout_error = str(e)

    lengths = (f"each request {args.max_tokens} tokens" if not args.spread else
               f"request lengths drawn from {args.max_tokens} x [{1 - args.spread:g}, {1 + args.spread:g}], the same for "
               f"every server; TTFT from each client's second request on (the opening burst left out)")
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
    for label in ("rayline", VLLM):
        for r in results[label]:
            if note := tail_note(r, args.rounds, args.spread, label.split(",")[0]):
                print(note)
    if rollout_s is not None:
        print(f"rollout time (alias set -> new version answering, tiny): {rollout_s:.1f}s")
    if rollout_error:
        print(f"rollout FAILED: {rollout_error}")
    ratios: dict = {}
    for baseline, must_match in ((DEFAULTS, []), (VLLM, MUST_MATCH)):
        for b, r in zip(results[baseline], results["rayline"]):
            ratios[(baseline, b.concurrency)] = r.tokens_per_s / b.tokens_per_s
            print(ratio_line(f"{baseline} ({b.concurrency} streams)", r.tokens_per_s / b.tokens_per_s,
                             setups["rayline"], setups[baseline], must_match))
    return {"results": results, "setups": setups, "rollout_s": rollout_s, "ratios": ratios}


if __name__ == "__main__":
    main()
