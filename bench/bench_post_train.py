"""Post-training (GRPO) on equal terms, three comparisons (issue 49):

    python bench/bench_post_train.py [--rounds 2] [--steps 4] [--sizes tiny,small] [--quick]

1. Rollout generation: rayline's rollout engine (a vLLM engine in a Ray actor, posttrain/grpo/rollout_pool.py) vs
   plain vLLM (`vllm.LLM` in this process) generating the same prompts with the same sampling (G samples each,
   temperature 1, a seed per prompt) and the same engine settings (configs/post_train/grpo_tiny.yaml's engine: both
   take serve/online/engine.py's kwargs and thread environment), in alternating rounds; output tokens/s as each caller sees.
2. Weight sync: the policy's new weights into the running engine (gather + `load_weights` through the worker
   extension, posttrain/grpo/weight_sync.py) vs the naive way, writing a Hugging Face checkpoint and starting an
   engine on it; seconds per update, for the tiny and small models (stack/tiny_model.py).
3. GRPO steps/s: rayline's loop (posttrain/grpo/loop.py: vLLM rollouts, Ray reward tasks, the FSDP2 policy) vs TRL's
   `GRPOTrainer` as a user would run it on this CPU (its own generation with transformers: TRL 1.16 supports vLLM
   up to 0.31, this venv has 0.32), both on the same warm tiny policy (stack/warm_policy.py), the same reward
   (posttrain/grpo/rewards.exact_answer), group size, prompts per step, completion length, learning rate, beta 0 and
   steps; start-up (engines, model loads) and the first step (warm-up: the reward tasks' workers start) are left
   out of both.

Each part prints both set-ups and ends with `rayline vs <baseline>: <ratio>x`. Needs Ray (a local instance is started
on the machine's CPUs) and `pip install trl` (the dev extra). The machine may be shared: say so beside any figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402
from stack.warm_policy import warm_policy, write_prompts  # noqa: E402
from core.config import load_config  # noqa: E402
from posttrain.grpo.config import GrpoConfig  # noqa: E402
from serve.online import engine as eng  # noqa: E402

CONFIG = ROOT / "configs" / "post_train" / "grpo_tiny.yaml"
ENGINE_MUST_MATCH = ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enforce_eager",
                     "enable_prefix_caching", "kv_cache_memory_bytes", "executor", "EngineCore", "OMP_NUM_THREADS",
                     "VLLM_ENABLE_V1_MULTIPROCESSING")
GRPO_MUST_MATCH = ("model", "reward", "group size", "prompts per step", "max completion tokens", "temperature",
                   "learning rate", "beta", "steps", "dtype")


def prompt_ids(cfg: GrpoConfig, model_dir: Path, n: int) -> list[tuple[int, list[int]]]:
    from transformers import AutoTokenizer

    from posttrain.grpo.prompts import load_prompts

    path = write_prompts(Path(tempfile.mkdtemp()) / "prompts.jsonl", n, seed=1)
    return [(p.index, p.ids) for p in load_prompts(str(path), AutoTokenizer.from_pretrained(model_dir))]


def rollout_part(cfg: GrpoConfig, model_dir: Path, rounds: int) -> None:
    import ray

    from posttrain.grpo.rollout_pool import RolloutPool
    from serve.batch.engine_setup import effective_setup

    os.environ.update(eng.runtime_env(cfg.engine)["env_vars"])  # plain vLLM: the same thread environment
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = prompt_ids(cfg, model_dir, cfg.prompts_per_step)
    pool = RolloutPool(str(model_dir), cfg.engine, 1)
    plain = LLM(model=str(model_dir), **eng.vllm_engine_kwargs(cfg.engine))
    setups = {"rayline": ray.get(pool.actors[0].setup.remote()), "plain vllm": effective_setup(plain.llm_engine)}
    rates: dict[str, list[float]] = {"rayline": [], "plain vllm": []}
    params = [SamplingParams(n=cfg.group_size, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=i)
              for i in range(len(prompts))]
    for order in round_order(list(rates), rounds):
        for side in order:
            start = time.perf_counter()
            if side == "rayline":
                tokens = sum(st["tokens"] for _, st in ray.get(pool.generate(prompts, cfg.group_size, cfg.max_tokens,
                                                                            cfg.temperature, 0)))
            else:
                outs = plain.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts], params,
                                      use_tqdm=False)
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            rates[side].append(tokens / (time.perf_counter() - start))
    print("\n## 1. rollout generation "
          f"({len(prompts)} prompts x {cfg.group_size} samples, max {cfg.max_tokens} tokens, {rounds} rounds)")
    print_setups(setups)
    for side, r in rates.items():
        print(f"{side}: {statistics.median(r):.0f} output tokens/s (rounds: {', '.join(f'{x:.0f}' for x in r)})")
    ratio = statistics.median(rates["rayline"]) / statistics.median(rates["plain vllm"])
    print(ratio_line("plain vllm", ratio, setups["rayline"], setups["plain vllm"], ENGINE_MUST_MATCH))
    ray.kill(pool.actors[0])
    del plain


def sync_part(cfg: GrpoConfig, sizes: list[str], work: Path, rounds: int) -> None:
    import ray

    from stack.tiny_model import build_tiny_model
    from posttrain.grpo.policy import policy_group
    from posttrain.grpo.rollout_pool import RolloutPool, rollout_actor
    from train.export import write_hf_checkpoint

    print(f"\n## 2. weight sync: in place vs a checkpoint written and a new engine started on it ({rounds} rounds)")
    for size in sizes:
        model_dir = build_tiny_model(work / f"sync-{size}", size)
        engine_cfg = dataclasses.replace(cfg.engine, model=str(model_dir))  # the GRPO config's engine, this model
        pool = RolloutPool(str(model_dir), engine_cfg, 1)
        (policy,) = policy_group(str(model_dir), 1, cfg.policy.cpus_per_worker, cfg.policy.threads, 1e-4, 0.0, 0.2,
                                 0.0, 0)
        ray.get(pool.actors[0].pid.remote())
        in_place, naive = [], []
        for i in range(rounds):
            start = time.perf_counter()
            pool.load_weights(policy.full_weights.remote(), i + 1)
            in_place.append(time.perf_counter() - start)
            start = time.perf_counter()
            import torch

            weights = {k: torch.from_numpy(v) for k, v in ray.get(policy.full_weights.remote()).items()}
            out = write_hf_checkpoint(weights, str(model_dir), work / f"ckpt-{size}-{i}", torch.float32, {})
            # The naive way replaces the engine: the old one goes first (its CPUs), a new one starts on the checkpoint,
            # and the next round's in-place update goes into that one.
            ray.kill(pool.actors[0], no_restart=True)
            fresh = rollout_actor(str(out), engine_cfg)
            ray.get(fresh.pid.remote())
            naive.append(time.perf_counter() - start)
            pool.actors[0] = fresh
        params = sum(v.size for v in ray.get(policy.full_weights.remote()).values())
        print(f"{size} model ({params / 1e6:.1f}M parameters): in place {statistics.median(in_place):.2f} s, "
              f"checkpoint + new engine {statistics.median(naive):.2f} s per update")
        print(f"rayline vs checkpoint round trip ({size}): {statistics.median(naive) / statistics.median(in_place):.1f}x")
        ray.kill(pool.actors[0])
        ray.kill(policy)


def rayline_grpo(cfg: GrpoConfig, model_dir: Path, prompts_path: Path, work: Path) -> tuple[float, dict]:
    from transformers import AutoTokenizer

    from posttrain.grpo import loop
    from posttrain.grpo.prompts import load_prompts

    prompts = load_prompts(str(prompts_path), AutoTokenizer.from_pretrained(model_dir))
    res = loop.run(cfg, str(model_dir), prompts, work / f"rayline-grpo-{time.time_ns()}")
    print(f"rayline start-up (engines and policy up): {res.startup_s:.1f} s", flush=True)
    steady = res.history[1:] or res.history  # the first step, warm-up (the reward tasks' workers start), left out
    seconds = sum(m.step_s for m in steady)
    for m in res.history:  # where a step's time went (the loop's own figures)
        print(f"rayline step {m.step}: {m.step_s:.2f} s (weight sync {m.weight_sync_s:.2f} s, reward wait "
              f"{m.reward_wait_s:.2f} s, rollout {m.rollout_tokens_per_s:.0f} tok/s)", flush=True)
    return len(steady) / seconds, {"generation": "vLLM engine in a Ray actor (uni executor)",
                                 "policy": "FSDP2 actor (gloo)", "reward": cfg.reward.name,
                                 "rewards last step": round(res.history[-1].reward_mean, 3)}


def trl_grpo(cfg: GrpoConfig, model_dir: Path, prompts_path: Path, work: Path) -> tuple[float, dict]:
    import json

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.grpo.rewards import exact_answer

    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["messages"][:-1], "answer": r["messages"][-1]["content"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        # TRL strips the EOS; a completion shorter than the limit ended on it.
        return [exact_answer(t, True, a) for t, a in zip(texts, answer)]

    torch.set_num_threads(cfg.policy.threads or 1)
    args = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
                      num_generations=cfg.group_size, max_completion_length=cfg.max_tokens,
                      temperature=cfg.temperature, learning_rate=cfg.policy.lr, beta=cfg.policy.beta,
                      max_steps=cfg.steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                      bf16=False, seed=cfg.seed, lr_scheduler_type="constant", dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[StepClock()])
    trainer.train()
    steady = times[1:] or times  # the first step, warm-up, left out as on rayline's side
    print(f"trl steps: {', '.join(f'{t:.2f} s' for t in times)}", flush=True)
    return len(steady) / sum(steady), {"generation": "transformers generate (TRL's default)",
                                     "policy": "one process (torch)", "reward": "exact_answer",
                                     "torch threads": torch.get_num_threads()}


def grpo_part(cfg: GrpoConfig, model_dir: Path, work: Path, steps: int) -> None:
    prompts_path = write_prompts(work / "grpo-prompts.jsonl", 400, seed=1)
    cfg = load_config(GrpoConfig, CONFIG, [f"steps={steps}", f"model={model_dir}", f"prompts.uri={prompts_path}",
                                           "output_uri=unused", "mlflow_experiment=", "checkpoint_every=0"])
    common = {"model": str(model_dir), "reward": "exact_answer", "group size": cfg.group_size,
              "prompts per step": cfg.prompts_per_step, "max completion tokens": cfg.max_tokens,
              "temperature": cfg.temperature, "learning rate": cfg.policy.lr, "beta": cfg.policy.beta,
              "steps": steps, "dtype": "float32"}
    ours_rate, ours = rayline_grpo(cfg, model_dir, prompts_path, work)
    trl_rate, theirs = trl_grpo(cfg, model_dir, prompts_path, work)
    setups = {"rayline": {**common, **ours}, "trl GRPOTrainer": {**common, **theirs}}
    print(f"\n## 3. GRPO steps/s ({steps} steps; start-up and the first step, warm-up, left out of both)")
    print_setups(setups)
    print(f"rayline: {ours_rate:.3f} steps/s; trl GRPOTrainer: {trl_rate:.3f} steps/s")
    print(ratio_line("trl GRPOTrainer", ours_rate / trl_rate, setups["rayline"], setups["trl GRPOTrainer"],
                     GRPO_MUST_MATCH))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--parts", default="rollout,sync,grpo")
    p.add_argument("--quick", action="store_true", help="one round, 2 GRPO steps, the tiny model only")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sizes = 1, 2, "tiny"
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    work = Path(tempfile.mkdtemp(prefix="bench-post-train-"))
    model_dir = warm_policy(work / "warm")
    parts = args.parts.split(",")
    cfg = load_config(GrpoConfig, CONFIG, [f"model={model_dir}", "prompts.uri=unused", "output_uri=unused"])
    print(f"machine: {os.cpu_count()} CPUs (shared with other work: figures vary run to run)")
    if "rollout" in parts:
        rollout_part(cfg, model_dir, args.rounds)
    if "sync" in parts:
        sync_part(cfg, args.sizes.split(","), work, args.rounds)
    if "grpo" in parts:
        grpo_part(cfg, model_dir, work, args.steps)


if __name__ == "__main__":
    main()
