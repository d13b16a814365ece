"""Batch inference throughput: Hugging Face `generate` vs plain vLLM vs rayline's batch stage, on CPU.

    python bench/bench_batch_infer.py [--prompts 512] [--work /tmp/rayline-bench]

The `small` tiny-model kit checkpoint answers 512 chat prompts whose output lengths are mixed (16 to 256
tokens, exact: per-request max_tokens with ignore_eos). Output tokens per second of:
  (a) Hugging Face `generate` with static batches (left-padded; best of batch 32 and 64; a batch runs until
      its longest request, and only each request's own tokens count; the first --hf-prompts prompts),
  (b) plain vLLM `LLM.generate` in one process (steady state: the generate call; end to end: every import
      (torch, transformers, vLLM), the chat template, engine start-up and the generate call),
  (c) rayline's stage (`serve.batch.pipeline.main` on its own local Ray): steady state over the engine's busy
      time, and end to end including every import, Ray start, model resolution, engine start-up and writing
      Parquet; (c') the same on a running Ray (a head started with the local stack and settled before the
      clock), the driver a fresh process whose clock starts before its first import, as
      `python -m pipelines.batch_infer` runs against the local stack or a Ray job on its cluster.
The end-to-end ratios are (c) and (c') end to end over (b) end to end; both clocks start before any import.
(a), (b) and (c) compute with the same threads: the engine settings' (serve/engine.py: one compute thread for
an engine that reserves one CPU, the rest of a 2-core node left to Ray Data's other stages). (a'), (b') and
(c'') are (a), (b) and (c) with a compute thread per core, torch's and plain vLLM's own default, compared
with each other. Each part runs in its own process, one at a time, --rounds times in alternating order
(a b c c' a' b' c'' | c'' b' a' c' c b a), and is pooled over its rounds: the machine's speed drifts within
minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE = {  # serve.engine.EngineConfig fields, shared by (b) and (c)
    "accelerator": "cpu", "max_model_len": 512, "max_num_seqs": 128, "dtype": "bfloat16", "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 1024**2, "cpus_per_engine": 1.0, "enable_prefix_caching": False,
}


def engine_fields(all_cores: bool) -> dict:
    """ENGINE, or ENGINE with a compute thread per core (vLLM's own default on CPU)."""
    return {**ENGINE, "env_vars": {"OMP_NUM_THREADS": str(os.cpu_count())}} if all_cores else ENGINE


def workload(work: Path, n: int, seed: int = 0) -> dict:
    """The small model, n chat prompts (sample-corpus questions) and their exact output lengths."""
    from pipelines.sample_corpus import make_records
    from pipelines.tiny_model import build_tiny_model

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


def chat_prompts(model: str, prompts: str) -> tuple[list[str], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    return texts, [r["sampling_params"]["max_tokens"] for r in rows]


def part_hf(w: dict, n: int, all_cores: bool = False) -> dict:
    """(a) static batches: left-pad, generate until the batch's longest request, count each request's own tokens.
    Runs the first n prompts only (it is the slow baseline; tokens/s over a sample of the same mix), with the
    engine's compute threads, or with `all_cores` a thread per core (torch's default)."""
    from pipelines.config import from_dict
    from serve import engine as eng

    assert "torch" not in sys.modules, "torch was imported before its thread count was set"
    cfg = from_dict(eng.EngineConfig, {"model": w["model"], **engine_fields(all_cores)})
    os.environ["OMP_NUM_THREADS"] = eng.runtime_env(cfg)["env_vars"]["OMP_NUM_THREADS"]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, lengths = chat_prompts(w["model"], w["prompts"])
    texts, lengths = texts[:n], lengths[:n]
    tok = AutoTokenizer.from_pretrained(w["model"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=getattr(torch, ENGINE["dtype"])).eval()
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


def part_vllm(w: dict, all_cores: bool = False) -> dict:
    """(b) one process, one `LLM.generate` call over all prompts with per-request SamplingParams; with
    `all_cores`, one compute thread per core (plain vLLM's own default) instead of the engine config's."""
    from pipelines.config import from_dict
    from serve import engine as eng

    t0 = time.perf_counter()  # end to end from here: torch, transformers and vLLM imports, chat template, engine
    cfg = from_dict(eng.EngineConfig, {"model": w["model"], **engine_fields(all_cores)})
    # The same engine environment as rayline's engine actor, set before anything imports torch (transformers
    # does): torch reads OMP_NUM_THREADS once, at import, and would otherwise run one thread per core.
    assert "torch" not in sys.modules, "torch was imported before the engine environment was set"
    os.environ.update(eng.runtime_env(cfg).get("env_vars", {}))
    texts, lengths = chat_prompts(w["model"], w["prompts"])
    from vllm import LLM, SamplingParams

    llm = LLM(model=w["model"], **eng.vllm_engine_kwargs(cfg))
    startup = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0) for k in lengths]
    started = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    took = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(lengths), f"vLLM produced {tokens} tokens, expected {sum(lengths)}"
    return {"tokens_per_s": tokens / took, "e2e_tokens_per_s": tokens / (startup + took), "startup_s": startup,
            "generate_s": took}


def part_rayline(w: dict, work: Path, running_ray: bool = False, all_cores: bool = False) -> dict:
    """(c) the stage itself, prompts from JSONL to Parquet, on a 2-CPU Ray of its own (never a cluster someone
    else started on the machine). Its clock starts before the driver's first import. Ray is started inside
    that clock (ray.init), as a script that brings its own Ray pays it; with `running_ray` the driver joins
    a running one instead, as `python -m pipelines.batch_infer` joins the local stack's head and a Ray job
    its cluster (see part_rayline_on_running_ray). With `all_cores`, the engine computes with a thread per
    core (it still reserves one CPU)."""
    started = time.perf_counter()  # end to end from here, like (b): every import is in the clock
    import ray

    from pipelines.config import from_dict
    from serve.batch.config import Config
    from serve.batch.pipeline import main

    cfg = from_dict(Config, {
        "mode": "infer", "input_uri": w["prompts"], "output_uri": str(work / "rayline-out"), "overwrite": True,
        "engine": {"model": w["model"], **engine_fields(all_cores)},
        "batch_size": 32, "cpu_stage_num_cpus": 0.25,  # max_concurrent_batches: the stage's own (4 x 128 rows)
    }, "bench")
    if not running_ray:
        os.environ.pop("RAY_ADDRESS", None)
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    result = main(cfg)  # on a running Ray, main's init_ray connects (inside the clock)
    e2e_s = time.perf_counter() - started
    ray.shutdown()
    assert result.errors == 0 and result.output_tokens == sum(w["lengths"]), result
    return {
        "tokens_per_s": result.steady_output_tokens_per_s, "e2e_tokens_per_s": result.output_tokens / e2e_s,
        "e2e_s": e2e_s, "startup_s": e2e_s - result.output_tokens / result.steady_output_tokens_per_s,
    }


# A private 2-CPU Ray head (rayline's local stack, Ray part only) on ports clear of a default local stack.
BENCH_HEAD = {"ray_port": 26379, "dashboard_port": 28265, "ray_client_port": 20001, "dashboard_agent_port": 22365,
              "min_worker_port": 30002, "max_worker_port": 39999, "serve_port": 28000, "num_cpus": 2}


def part_rayline_on_running_ray(w: dict, work: Path, args) -> dict:
    """(c') (c) on a running cluster: a Ray head started with rayline's local stack (`ray start`, with its
    dashboard) and left to settle, then the stage's driver as a fresh process, its clock from its first
    import to its summary, as `python -m pipelines.batch_infer` runs against the local stack."""
    from pipelines import stack

    head = stack.StackConfig(state_dir=str(work / "ray-head"), **BENCH_HEAD)
    stack.up(head, parts=["ray"])
    try:
        time.sleep(5)  # let the head's processes finish starting, as on a cluster that was already up
        cmd = [sys.executable, __file__, "--part", "rayline-driver", "--prompts", str(args.prompts),
               "--work", str(args.work)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, **stack.env_vars(head)})
    finally:
        stack.down(head)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the stage's driver failed (exit {proc.returncode}); its log is above")
    return json.loads(lines[-1][len("RESULT "):])


ORDER = ["hf", "vllm", "rayline", "rayline-running-ray", "hf-all-cores", "vllm-all-cores", "rayline-all-cores"]


def pool(results: list[dict]) -> dict:
    """One part's rounds as one result: rates (keys ending in per_s) by harmonic mean, anything else by mean."""
    keys = results[0].keys()
    return {k: (len(results) / sum(1 / r[k] for r in results) if k.endswith("per_s") else
                sum(r[k] for r in results) / len(results)) for k in keys}


def run_part(part: str, args) -> dict:
    """Each part in its own process, so no engine, thread pool or allocator state leaks into the next."""
    cmd = [sys.executable, __file__, "--part", part, "--prompts", str(args.prompts), "--work", str(args.work),
           "--hf-prompts", str(args.hf_prompts)]
    print(f"--- {part} ...", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench part {part} failed (exit {proc.returncode}); its log is above")
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"--- {part}: {json.dumps({k: round(v, 2) for k, v in result.items()})}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--work", type=Path, default=Path("/tmp/rayline-bench"))
    p.add_argument("--hf-prompts", type=int, default=128, help="prompts (a) runs: at ~50 tok/s all 512 take an hour")
    p.add_argument("--rounds", type=int, default=2, help="runs of every part, alternating the order")
    p.add_argument("--part", choices=[*ORDER, "rayline-driver"], help=argparse.SUPPRESS)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    w = workload(args.work, args.prompts)
    if args.part:
        parts = {"hf": lambda: part_hf(w, args.hf_prompts), "vllm": lambda: part_vllm(w),
                 "rayline": lambda: part_rayline(w, args.work),
                 "rayline-running-ray": lambda: part_rayline_on_running_ray(w, args.work, args),
                 "rayline-driver": lambda: part_rayline(w, args.work, running_ray=True),
                 "hf-all-cores": lambda: part_hf(w, args.hf_prompts, all_cores=True),
                 "vllm-all-cores": lambda: part_vllm(w, all_cores=True),
                 "rayline-all-cores": lambda: part_rayline(w, args.work, all_cores=True)}
        result = parts[args.part]()
        print("RESULT " + json.dumps(result), flush=True)
        return

    # The machine's speed drifts by up to 2x within minutes, so every part runs --rounds times, in A-B-C..C-B-A
    # order, and each figure is pooled over its rounds (the same tokens each round: the harmonic mean of rates).
    runs: dict[str, list[dict]] = {name: [] for name in ORDER}
    for r in range(args.rounds):
        for name in (ORDER if r % 2 == 0 else ORDER[::-1]):
            runs[name].append(run_part(name, args))
    hf, vllm, rl, rl_running, hf_all, vllm_all, rl_all = (pool(runs[name]) for name in ORDER)
    print(f"\nworkload: {args.prompts} prompts, {sum(w['lengths']):,} output tokens (16-256 each), small model, "
          f"dtype {ENGINE['dtype']}, {os.cpu_count()} CPUs; {args.rounds} rounds per part, pooled")
    print(f"(a) hf generate, static batches:  {hf['tokens_per_s']:8.1f} tok/s "
          f"(batch 32: {hf['batch_32']:.1f}, batch 64: {hf['batch_64']:.1f}; first {int(hf['prompts'])} prompts; "
          f"{int(hf['threads'])} thread)")
    print(f"(b) vllm LLM.generate:            {vllm['tokens_per_s']:8.1f} tok/s steady state, "
          f"{vllm['e2e_tokens_per_s']:.1f} tok/s end to end (import + engine start {vllm['startup_s']:.1f} s)")
    print(f"(c) rayline batch stage:          {rl['tokens_per_s']:8.1f} tok/s steady state, "
          f"{rl['e2e_tokens_per_s']:.1f} tok/s end to end ({rl['e2e_s']:.1f} s, ~{rl['startup_s']:.1f} s start-up, "
          "Ray started in the clock)")
    print(f"(c') rayline on a running Ray:    {rl_running['tokens_per_s']:8.1f} tok/s steady state, "
          f"{rl_running['e2e_tokens_per_s']:.1f} tok/s end to end ({rl_running['e2e_s']:.1f} s, "
          f"~{rl_running['startup_s']:.1f} s start-up, the driver a fresh process)")
    print(f"a thread per core ({os.cpu_count()}), each side's own default:")
    print(f"(a') hf generate:                 {hf_all['tokens_per_s']:8.1f} tok/s "
          f"(batch 32: {hf_all['batch_32']:.1f}, batch 64: {hf_all['batch_64']:.1f})")
    print(f"(b') vllm LLM.generate:           {vllm_all['tokens_per_s']:8.1f} tok/s steady state, "
          f"{vllm_all['e2e_tokens_per_s']:.1f} tok/s end to end")
    print(f"(c'') rayline batch stage:        {rl_all['tokens_per_s']:8.1f} tok/s steady state, "
          f"{rl_all['e2e_tokens_per_s']:.1f} tok/s end to end")
    print(f"rayline vs hf generate: {rl['tokens_per_s'] / hf['tokens_per_s']:.1f}x")
    print(f"rayline vs vllm (steady state): {rl['tokens_per_s'] / vllm['tokens_per_s']:.2f}x")
    # End to end compares like with like: each side's tokens over its own start-up + generation time.
    print(f"rayline vs vllm (end to end): {rl['e2e_tokens_per_s'] / vllm['e2e_tokens_per_s']:.2f}x")
    print(f"rayline vs vllm (end to end, on a running Ray): "
          f"{rl_running['e2e_tokens_per_s'] / vllm['e2e_tokens_per_s']:.2f}x")
    print(f"rayline vs hf generate (a thread per core): {rl_all['tokens_per_s'] / hf_all['tokens_per_s']:.1f}x")
    print(f"rayline vs vllm (a thread per core, steady state): "
          f"{rl_all['tokens_per_s'] / vllm_all['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
