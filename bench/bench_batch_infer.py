"""Batch inference throughput on CPU: rayline's batch stage against plain vLLM laid out the same way, against
plain vLLM with its own defaults, and against Hugging Face `generate`.

    python bench/bench_batch_infer.py [--prompts 1024] [--rounds 2] [--quick] [--parts hf,vllm,rayline,...]

The `small` tiny-model kit checkpoint answers --prompts chat prompts whose output lengths are mixed (16 to 256
tokens, exact: per-request max_tokens with ignore_eos); 1,024 prompts (~139k output tokens) kept plain vLLM
generating for about 4 minutes on the 2-core box of 2026-12-01, and for 2 on that of 2026-12-06 (an AVX-512 CPU):
the end-to-end comparison is defined on at least 3 minutes of it, so the report says when (b) generated for less
and which --prompts would be enough on this machine. --quick is a smoke run of under 3 minutes (64 prompts, one
round, (a) on 8 prompts). Parts:
  (a) hf: Hugging Face `generate` with static batches (left-padded; best of batch 32 and 64; a batch runs until
      its longest request and only each request's own tokens count; the first --hf-prompts prompts), with the
      engine's compute threads (one).
  (b) vllm: plain vLLM laid out as rayline's engine: vLLM's AsyncLLMEngine as Ray's stage runs it (EngineCore
      in a process of its own, forked), rayline's engine environment and engine kwargs (serve/online/engine.py
      runtime_env, vllm_engine_kwargs), the niceness Ray gives its workers (15), requests for the final output
      only, prompts templated and tokenized as rayline's validator does them, answers written as Parquet.
  (c) rayline: `serve.batch.pipeline.main`, prompts from JSONL to Parquet, on a 2-CPU Ray of its own started
      inside the clock (ray.init).
  (c') rayline-running-ray (only with --parts): (c)'s driver as a fresh process against a running head started
      with the local stack, as `python -m pipelines.batch_infer` runs against it.
  (d) vllm-defaults: what a user would compare with: `LLM(model, kv_cache_memory_bytes=...)`, everything else
      vLLM's own defaults (a compute thread per core, its own executor and batch limits), `LLM.chat`.
One clock for every part: end to end from before its first import (torch, transformers, vLLM, Ray) to its
last answer written. Steady state, for (b) and (c) alike: output tokens over the engine's busy time, first
request queued to last token, from vLLM's per-request timestamps (EngineCore's clock) as written next to
each answer. (d) has no such timestamps (LLM turns stats off), so its steady state is its `LLM.chat` call.
Each part's effective set-up is read back from its running engine and processes and printed; the (b)-(c)
ratios are printed only when the set-ups agree on everything in MUST_MATCH (bench/equal_terms.py). Each part
runs in its own process, one at a time, in alternating order over --rounds rounds, pooled over its rounds
(the machine's speed drifts within minutes); (a) and (d) run in the first round only (a b c d | c b), which
keeps a default run under 25 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.batch_figures import pool, report  # noqa: E402
from bench.equal_terms import busy_threads, process_tree, round_order, thread_times  # noqa: E402
from serve.online.precision import resolve_dtype  # noqa: E402

ENGINE = {  # serve.online.engine.EngineConfig fields, shared by (b) and (c)
    # auto, as the batch stage's configs have it: bfloat16 on a CPU with AVX-512 BF16 / AMX, float32 elsewhere
    # (serve/online/precision.py), on both sides. Which dtype is faster is the CPU's: one thread's GEMM at 128 x 512 x 1408
    # ran 72.7 GFLOP/s in float32 against 8.0 in bfloat16 on the AVX2-only CPU of 2026-12-01, and 93-98 against 210
    # on the AVX-512 BF16 CPU of 2026-12-06.
    "accelerator": "cpu", "max_model_len": 512, "max_num_seqs": 128, "dtype": "auto", "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 1024**2, "cpus_per_engine": 1.0, "enable_prefix_caching": False,
}
DTYPE = resolve_dtype(ENGINE["dtype"], ENGINE["accelerator"])  # what (a) runs in and the report names
RAY_WORKER_NICENESS = 15  # Ray starts its workers, and so the engine actor and its EngineCore, at niceness 15
MUST_MATCH = [  # what (b) and (c) must agree on for a ratio
    "EngineCore", "EngineCore start", "executor", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
    "dtype", "enforce_eager", "enable_prefix_caching", "kv_cache_memory_bytes", "stats logging", "output kind",
    "engine processes", "engine niceness", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
]
PARTS = ["hf", "vllm", "rayline", "rayline-running-ray", "vllm-defaults"]
DEFAULT_PARTS = ["hf", "vllm", "rayline", "vllm-defaults"]
ONCE = {"hf", "vllm-defaults"}  # context figures, run in the first round only: the rounds are for (b) against (c)


def workload(work: Path, n: int, seed: int = 0) -> dict:
    """The small model, n chat prompts (sample-corpus questions) and their exact output lengths."""
    from stack.sample_corpus import make_records
    from stack.tiny_model import build_tiny_model

    model = work / "small-model"
    if not (model / "config.json").exists():
        build_tiny_model(model, "small", seed=seed)
    rng = random.Random(seed)
    records = make_records(n, seed + 7, "bench")
    lengths = [rng.randint(16, 256) for _ in range(n)]
    rows = [
        {"id": r["id"], "messages": [m for m in r["messages"] if m["role"] != "assistant"],
         "sampling_params": {"max_tokens": k, "ignore_eos": True, "temperature": 0.0}}
        for r, k in zip(records, lengths)
    ]
    prompts = work / f"prompts-{n}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(model), "prompts": str(prompts), "lengths": lengths}


def prompt_rows(w: dict) -> list[dict]:
    return [json.loads(line) for line in Path(w["prompts"]).read_text().splitlines()]


def engine_env() -> dict[str, str]:
    """rayline's engine environment for ENGINE (serve/online/engine.py runtime_env), as the engine actor gets it."""
    from core.config import from_dict
    from serve.online import engine as eng

    return eng.runtime_env(from_dict(eng.EngineConfig, {"model": "m", **ENGINE})).get("env_vars", {})


def write_answers(path: Path, answers: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(answers), path)


def answer_figures(out_dir: Path, t0: float, e2e_s: float, expected_tokens: int) -> dict:
    """Figures every engine part reports the same way, from the Parquet it wrote: end to end, steady state
    (output tokens over first request queued -> last token, EngineCore's clock) and, on the same monotonic
    clock as t0, when the first request reached the engine and how long after its last token the part ended."""
    import pyarrow.parquet as pq

    table = pq.read_table(out_dir)
    tokens = sum(table.column("output_tokens").to_pylist())
    assert tokens == expected_tokens, f"{out_dir}: {tokens} output tokens, expected {expected_tokens}"
    out = {"e2e_s": e2e_s, "e2e_tokens_per_s": tokens / e2e_s}
    starts = [s for s in table.column("engine_start_s").to_pylist() if s is not None]
    ends = [s for s in table.column("engine_end_s").to_pylist() if s is not None]
    if starts and ends:
        out["tokens_per_s"] = tokens / (max(ends) - min(starts))
        out["first_request_s"] = min(starts) - t0
        out["after_last_token_s"] = t0 + e2e_s - max(ends)
    return out


def part_hf(w: dict, n: int) -> dict:
    """(a) static batches: left-pad, generate until the batch's longest request, count each request's own tokens.
    Runs the first n prompts only (it is the slow baseline; tokens/s over a sample of the same mix), with the
    engine's compute threads."""
    assert "torch" not in sys.modules, "torch was imported before its thread count was set"
    os.environ["OMP_NUM_THREADS"] = engine_env()["OMP_NUM_THREADS"]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = prompt_rows(w)[:n]
    tok = AutoTokenizer.from_pretrained(w["model"], padding_side="left")
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    lengths = [r["sampling_params"]["max_tokens"] for r in rows]
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=getattr(torch, DTYPE)).eval()
    out = {}
    for batch in (32, 64):
        started = time.perf_counter()
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            longest = max(lengths[i:i + batch])
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                               pad_token_id=tok.pad_token_id)
        out[f"batch_{batch}"] = sum(lengths) / (time.perf_counter() - started)
    out["prompts"], out["threads"] = len(texts), torch.get_num_threads()
    out["tokens_per_s"] = max(out["batch_32"], out["batch_64"])
    return out


def part_vllm(w: dict, work: Path) -> dict:
    """(b) plain vLLM laid out as rayline's engine (see the module docstring); its clock starts before its first
    import and ends when its answers are written."""
    t0 = time.monotonic()
    # run_part started this process as Ray starts the engine actor: rayline's engine environment, niceness 15.
    assert all(os.environ.get(k) == v for k, v in engine_env().items()), "not started with the engine's environment"
    import asyncio

    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from core.config import from_dict
    from serve.online import engine as eng
    from serve.batch.engine_setup import effective_setup

    eng.apply_engine_core_start()  # fork EngineCore, as the engine actor does
    cfg = from_dict(eng.EngineConfig, {"model": w["model"], **ENGINE})
    rows = prompt_rows(w)
    tok = AutoTokenizer.from_pretrained(w["model"])

    async def run() -> tuple[list, dict]:
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=w["model"], **eng.vllm_engine_kwargs(cfg)))
        setup = effective_setup(engine)
        read_back = read_back_in_background(os.getpid(), setup)

        async def answer(i: int, row: dict):
            text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]  # as rayline's validator does
            params = SamplingParams(**row["sampling_params"], output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, str(i)):
                if out.finished:
                    return out

        async def log_stats():  # as Ray's stage does after each batch (and vLLM's server every few seconds)
            while True:
                await asyncio.sleep(5)
                await engine.do_log_stats()

        stats = asyncio.create_task(log_stats())
        outs = await asyncio.gather(*(answer(i, r) for i, r in enumerate(rows)))
        stats.cancel()
        engine.shutdown()
        return outs, setup, read_back

    outs, setup, read_back = asyncio.run(run())
    out_dir = work / "vllm-out"
    write_answers(out_dir / "answers.parquet", {
        "id": [r["id"] for r in rows], "output": [o.outputs[0].text for o in outs],
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "engine_start_s": [o.metrics.queued_ts for o in outs], "engine_end_s": [o.metrics.last_token_ts for o in outs],
    })
    e2e_s = time.monotonic() - t0
    read_back.join()
    setup["output kind"] = "FINAL_ONLY"
    return {**answer_figures(out_dir, t0, e2e_s, sum(w["lengths"])), "setup": setup}


def part_vllm_defaults(w: dict, work: Path) -> dict:
    """(d) plain vLLM as a user starts it: `LLM` with only the KV cache size this box needs, `LLM.chat`."""
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    from serve.batch.engine_setup import effective_setup

    rows = prompt_rows(w)
    llm = LLM(model=w["model"], kv_cache_memory_bytes=ENGINE["kv_cache_memory_bytes"])
    setup = {**effective_setup(llm.llm_engine), "output kind": "FINAL_ONLY"}
    read_back = read_back_in_background(os.getpid(), setup)
    started = time.monotonic()
    outs = llm.chat([r["messages"] for r in rows], [SamplingParams(**r["sampling_params"]) for r in rows],
                    use_tqdm=False)
    call_s = time.monotonic() - started
    out_dir = work / "vllm-defaults-out"
    write_answers(out_dir / "answers.parquet", {
        "id": [r["id"] for r in rows], "output": [o.outputs[0].text for o in outs],
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "engine_start_s": [None] * len(rows), "engine_end_s": [None] * len(rows),
    })
    e2e_s = time.monotonic() - t0
    read_back.join()
    figures = answer_figures(out_dir, t0, e2e_s, sum(w["lengths"]))
    return {**figures, "tokens_per_s": sum(w["lengths"]) / call_s, "setup": setup}


def part_rayline(w: dict, work: Path, running_ray: bool = False) -> dict:
    """(c) the stage itself, prompts from JSONL to Parquet, on a 2-CPU Ray of its own (never a cluster someone
    else started on the machine), Ray started inside the clock; with `running_ray` the driver joins a running
    one instead (see part_rayline_on_running_ray)."""
    t0 = time.monotonic()  # end to end from here, like (b): every import is in the clock
    import ray

    from core.config import from_dict
    from serve.batch.config import Config
    from serve.batch.pipeline import main

    cfg = from_dict(Config, {
        "mode": "infer", "input_uri": w["prompts"], "output_uri": str(work / "rayline-out"), "overwrite": True,
        "engine": {"model": w["model"], **ENGINE},
        "batch_size": 32, "cpu_stage_num_cpus": 0.25,  # max_concurrent_batches: the stage's own (4 x 128 rows)
    }, "bench")
    if not running_ray:
        os.environ.pop("RAY_ADDRESS", None)
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    engine = {}
    read_back = threading.Thread(target=lambda: engine.update(engine_actor_processes()), daemon=True)
    read_back.start()
    result = main(cfg)  # on a running Ray, main's init_ray connects (inside the clock)
    e2e_s = time.monotonic() - t0
    read_back.join(timeout=60)  # outside the clock; a job shorter than its window leaves the figures out
    ray.shutdown()
    assert result.errors == 0, result
    return {**answer_figures(Path(cfg.output_uri), t0, e2e_s, sum(w["lengths"])), "setup": engine}


def engine_processes(pid: int, settle_s: float = 5, window_s: float = 10) -> dict:
    """The engine's processes (front end, EngineCore and any of theirs) read back from the OS, `settle_s` after
    the call (generation under way): how many, their niceness, and how many threads computed over `window_s`."""
    time.sleep(settle_s)
    before = thread_times(pid)
    time.sleep(window_s)
    tree = process_tree(pid)  # its environment figures are left out: see engine_setup.effective_setup
    return {"engine processes": tree["processes"], "engine niceness": tree["niceness"],
            "engine busy threads": busy_threads(before, thread_times(pid))}


def read_back_in_background(pid: int, into: dict, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.update(engine_processes(pid, **kwargs)), daemon=True)
    thread.start()
    return thread


def engine_actor_processes(timeout_s: float = 600) -> dict:
    """engine_processes of rayline's engine actor, once it has started its EngineCore."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            if "EngineStageUDF" in " ".join(p.info["cmdline"] or []) and p.children():
                return engine_processes(p.pid, settle_s=20)  # EngineCore forked: the engine loads, then runs
        time.sleep(1)
    return {}


# A private 2-CPU Ray head (rayline's local stack, Ray part only) on ports clear of a default local stack.
BENCH_HEAD = {"ray_port": 26379, "dashboard_port": 28265, "ray_client_port": 20001, "dashboard_agent_port": 22365,
              "min_worker_port": 30002, "max_worker_port": 39999, "serve_port": 28000, "num_cpus": 2}


def part_rayline_on_running_ray(w: dict, args) -> dict:
    """(c') (c) on a running cluster: a Ray head started with rayline's local stack (`ray start`, with its
    dashboard) and left to settle, then the stage's driver as a fresh process, its clock from its first
    import to its summary, as `python -m pipelines.batch_infer` runs against the local stack."""
    from stack import lifecycle as stack

    head = stack.StackConfig(state_dir=str(args.work / "ray-head"), **BENCH_HEAD)
    stack.up(head, parts=["ray"])
    try:
        time.sleep(5)  # let the head's processes finish starting, as on a cluster that was already up
        cmd = [sys.executable, __file__, "--part", "rayline-driver", "--prompts", str(args.prompts),
               "--work", str(args.work)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, **stack.env_vars(head)})
    finally:
        stack.down(head)
    return part_output(proc, "rayline-driver")


def part_output(proc: subprocess.CompletedProcess, part: str) -> dict:
    """A part's RESULT line, its set-up completed with the engine actor's own set-up line, if it printed one."""
    from serve.batch.engine_setup import SETUP_LINE

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench part {part} failed (exit {proc.returncode}); its log is above")
    result = json.loads(lines[-1][len("RESULT "):])
    for ln in proc.stdout.splitlines():
        if SETUP_LINE in ln:  # Ray forwards the engine actor's output to its driver
            result["setup"] = {**json.loads(ln.split(SETUP_LINE, 1)[1]), **result["setup"],
                               "output kind": "FINAL_ONLY"}  # serve/batch/engine_stage.final_outputs_only
    return result


def run_part(part: str, args) -> dict:
    """Each part in its own process, so no engine, thread pool or allocator state leaks into the next."""
    cmd = [sys.executable, __file__, "--part", part, "--prompts", str(args.prompts), "--work", str(args.work),
           "--hf-prompts", str(args.hf_prompts)]
    print(f"--- {part} ...", flush=True)
    env, nice = dict(os.environ), None
    if part == "vllm":  # as Ray starts a worker: the engine environment from the start, then niceness 15
        env.update(engine_env())
        nice = lambda: os.nice(RAY_WORKER_NICENESS - os.nice(0))  # noqa: E731
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env, preexec_fn=nice)
    result = part_output(proc, part)
    shown = {k: round(v, 2) for k, v in result.items() if isinstance(v, (int, float))}
    print(f"--- {part}: {json.dumps(shown)}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--work", type=Path, default=Path("/tmp/rayline-bench"))
    p.add_argument("--hf-prompts", type=int, default=64, help="prompts (a) runs (the slow baseline: a sample of the mix)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every part, alternating the order")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="a smoke run of under 3 minutes: 64 prompts, one round")
    p.add_argument("--part", choices=[*PARTS, "rayline-driver"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.rounds, args.hf_prompts = 64, 1, 8
    args.work.mkdir(parents=True, exist_ok=True)
    w = workload(args.work, args.prompts)
    if args.part:
        parts = {"hf": lambda: part_hf(w, args.hf_prompts), "vllm": lambda: part_vllm(w, args.work),
                 "rayline": lambda: part_rayline(w, args.work),
                 "rayline-running-ray": lambda: part_rayline_on_running_ray(w, args),
                 "rayline-driver": lambda: part_rayline(w, args.work, running_ray=True),
                 "vllm-defaults": lambda: part_vllm_defaults(w, args.work)}
        print("RESULT " + json.dumps(parts[args.part]()), flush=True)
        return

    chosen = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown part(s) {unknown}; known: {','.join(PARTS)}")
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for i, order in enumerate(round_order(chosen, args.rounds)):
        for name in order:
            if i == 0 or name not in ONCE:
                runs[name].append(run_part(name, args))
    report(args, w, {name: pool(r) for name, r in runs.items()}, DTYPE, MUST_MATCH)


if __name__ == "__main__":
    main()
