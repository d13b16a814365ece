"""The GRPO driver (verl's single controller): one loop that drives the rollout pool, the reward tasks and the
policy's ranks through Ray, one policy update per batch:

    take P prompts at the cursor -> the engines sample G completions each (every sample records the engine's policy
    step) -> reward tasks score them (bounded in flight) -> group-relative advantages -> one GRPO step on the policy's
    ranks -> the new weights go to the engines in place -> ledger line, metrics, and every `checkpoint_every` steps a
    checkpoint of the policy and the cursor.

With `max_staleness` s > 0 the engines generate up to s batches ahead while the policy trains (each such batch lags
by at most s steps). A lost engine or policy rank (Ray's RayActorError) restarts both roles from the last
checkpoint: the cursor and the ledger go back to it, so every prompt is consumed exactly once in the run's history
and no update mixes samples of two policy steps (ledger.check_history holds the run to that).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ray
import torch

from posttrain.grpo.advantages import group_advantages
from posttrain.grpo.backpressure import BoundedScorer
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.ledger import Ledger, check_history
from posttrain.grpo.placement import role_placements
from posttrain.grpo.policy import policy_group
from posttrain.grpo.prompts import Prompt, take
from posttrain.grpo.reward_pool import RewardPool
from posttrain.grpo.rollout_pool import RolloutPool, Sample
from serve.batch.metrics import exact_match

STATE_FILE = "grpo_state.json"
"""Written last into a checkpoint directory: the policy step and the prompt cursor (its presence marks it complete)."""


@dataclass
class StepMetrics:
    step: int
    reward_mean: float
    reward_std: float
    kl: float
    loss: float
    rollout_tokens_per_s: float
    weight_sync_s: float
    policy_lag: int
    prompts_consumed: int
    reward_wait_s: float
    step_s: float


@dataclass
class LoopResult:
    steps: int
    prompts_consumed: int
    restarts: int
    startup_s: float = 0.0
    """Seconds from the roles' creation until every engine and policy rank was up (not in any step's time)."""
    history: list[StepMetrics] = field(default_factory=list)
    ledger: dict[str, int] = field(default_factory=dict)
    exact_match_before: float | None = None
    exact_match_after: float | None = None
    final_weights: dict | None = None


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(output: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint whose state file was written (a checkpoint cut short has none)."""
    done = sorted(p for p in (output / "checkpoints").glob("step_*") if (p / STATE_FILE).exists())
    return (done[-1], json.loads((done[-1] / STATE_FILE).read_text())) if done else None


class Roles:
    """The live actors: rollout pool and policy ranks, in their placement group; `restart()` replaces them all."""

    def __init__(self, cfg: GrpoConfig, model_dir: str, reward_dir: str = ""):
        self.cfg, self.model_dir = cfg, model_dir
        self.pg, engine_opts, policy_opts = role_placements(
            cfg.placement, cfg.engine.cpus_per_engine, cfg.num_engines, cfg.policy.cpus_per_worker,
            cfg.policy.num_workers)
        self.pool = RolloutPool(model_dir, cfg.engine, cfg.num_engines, engine_opts)
        self.rewards = RewardPool(reward_dir, cfg.reward.engine, cfg.reward.num_engines) if reward_dir else None
        self.policy_opts = policy_opts
        self.policy = self._policy()
        self.ready()

    def ready(self) -> None:
        """Wait until every engine and policy rank is up (their engines started, weights loaded, process group
        joined): the start-up stays out of the first step's time."""
        ray.get([a.pid.remote() for a in self.pool.actors + self.policy + (self.rewards.actors if self.rewards else [])])

    def _policy(self) -> list:
        p = self.cfg.policy
        return policy_group(self.model_dir, p.num_workers, p.cpus_per_worker, p.threads, p.lr, p.weight_decay, p.clip_eps,
                            p.beta, self.cfg.seed, self.policy_opts, p.lora)

    def restart(self) -> None:
        for worker in self.policy:
            ray.kill(worker, no_restart=True)
        self.pool.restart()
        if self.rewards:
            self.rewards.restart()
        self.policy = self._policy()
        self.ready()

    def sync(self, step: int) -> float:
        """The policy's weights into every engine (as policy step `step`); returns the slowest engine's seconds,
        gather included."""
        start = time.perf_counter()
        refs = [w.full_weights.remote() for w in self.policy]
        self.pool.load_weights(refs[0], step)
        ray.get(refs[1:])
        return time.perf_counter() - start

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.policy + self.pool.actors:
            ray.kill(actor, no_restart=True)
        if self.rewards:
            self.rewards.shutdown()
        remove_placement_group(self.pg)


def score_batch(cfg: GrpoConfig, scorer: BoundedScorer, samples: list[Sample], prompts: dict[int, Prompt],
                rewards: RewardPool | None = None) -> list[float]:
    """Each sample's reward, in order: the verifier's, or with `rewards` the reward model's score of the rendered
    prompt followed by the completion."""
    chunk = cfg.reward.chunk * cfg.group_size
    for i in range(0, len(samples), chunk):
        part = samples[i:i + chunk]
        if rewards is not None:
            scorer.submit([prompts[s.prompt_index].text + s.text for s in part], rewards)
        else:
            scorer.submit([(s.text, s.finished, prompts[s.prompt_index].reference) for s in part])
    return scorer.results()


def evaluate(pool: RolloutPool, prompts: list[Prompt], max_tokens: int) -> float:
    """Exact match (the batch eval's) of the engines' greedy answers to `prompts`."""
    outs = ray.get(pool.generate([(p.index, p.ids) for p in prompts], 1, max_tokens, 0.0, 0))
    by_index = {p.index: p for p in prompts}
    right = [exact_match(s.text, by_index[s.prompt_index].reference) for samples, _ in outs for s in samples]
    return sum(right) / len(right)


def run(cfg: GrpoConfig, model_dir: str, prompts: list[Prompt], output: Path,
        on_step: Callable[[StepMetrics], None] = lambda m: None, eval_prompts: list[Prompt] | None = None,
        before_update: Callable[[int, Roles, Path], None] | None = None, reward_dir: str = "") -> LoopResult:
    """Run (or resume, from the newest checkpoint under `output`) GRPO for `cfg.steps` updates; returns the history,
    exact match on `eval_prompts` before the first update of this call and after the last, and the final weights
    (HF names -> numpy) for export. `before_update(update, roles, output)`, when given, runs before each update's
    samples are collected (the tests' fault injector, tests/posttrain/grpo_faults.py). `reward_dir`: the reward
    model's checkpoint (`reward.name: model`), served by engines the roles hold."""
    output.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(output / "ledger.jsonl")
    scorer = BoundedScorer(cfg.reward.name, cfg.reward.max_in_flight, cfg.reward.delay_s)
    started_up = time.perf_counter()
    roles = Roles(cfg, model_dir, reward_dir)
    result = LoopResult(steps=0, prompts_consumed=0, restarts=0, startup_s=time.perf_counter() - started_up)
    P, G = cfg.prompts_per_step, cfg.group_size
    if (P * G) % cfg.policy.num_workers:
        raise ValueError(f"prompts_per_step x group_size ({P * G}) must split evenly over policy.num_workers "
                         f"({cfg.policy.num_workers}): FSDP ranks take equal shares")
    try:
        step, cursor = resume(roles, output, ledger)
        if eval_prompts:
            result.exact_match_before = evaluate(roles.pool, eval_prompts, cfg.max_tokens)
        ahead: deque = deque()  # (prompts, generation refs) submitted ahead, oldest first
        while step < cfg.steps:
            try:
                started = time.perf_counter()
                while len(ahead) < 1 + cfg.max_staleness and step + len(ahead) < cfg.steps:
                    position = cursor + P * len(ahead)
                    batch = take(prompts, position, P)
                    ahead.append((batch, roles.pool.generate([(p.index, p.ids) for p in batch], G, cfg.max_tokens,
                                                             cfg.temperature, cfg.seed + position)))
                batch, refs = ahead[0]
                if before_update is not None:
                    before_update(step + 1, roles, output)
                outs = ray.get(refs)
                samples = [s for part, _ in outs for s in part]
                samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
                tokens = sum(st["tokens"] for _, st in outs)
                gen_s = max(st["seconds"] for _, st in outs)
                policy_steps = sorted({s.policy_step for s in samples})
                lag = step - policy_steps[0]
                if len(policy_steps) != 1 or not 0 <= lag <= cfg.max_staleness:
                    raise RuntimeError(f"batch for update {step + 1} holds samples of policy steps {policy_steps}")
                rewards = torch.tensor(score_batch(cfg, scorer, samples, {p.index: p for p in batch}, roles.rewards))
                adv = group_advantages(rewards, G).tolist()
                rows = [(s.prompt_ids, s.completion_ids) for s in samples]
                W = len(roles.policy)
                parts = ray.get([w.train_step.remote(rows[r::W], adv[r::W], cfg.policy.micro_batch)
                                 for r, w in enumerate(roles.policy)])
                ahead.popleft()
                step += 1
                cursor += P
                sync_s = roles.sync(step)
                ledger.append(step, [p.index for p in batch], policy_steps, float(rewards.mean()))
                m = StepMetrics(step, float(rewards.mean()), float(rewards.std()),
                                sum(p["kl"] for p in parts) / W, sum(p["loss"] for p in parts) / W,
                                tokens / gen_s if gen_s else 0.0, sync_s, lag, cursor, scorer.waited_s,
                                time.perf_counter() - started)
                scorer.waited_s = 0.0
                result.history.append(m)
                on_step(m)
                if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    save(roles, output, step, cursor)
            except ray.exceptions.RayActorError as e:
                result.restarts += 1
                if result.restarts > cfg.max_restarts:
                    raise RuntimeError(f"GRPO lost a role {result.restarts} times (max_restarts "
                                       f"{cfg.max_restarts}): {e}") from e
                print(f"grpo: lost a role at update {step + 1} ({type(e).__name__}); resuming from the last "
                      "checkpoint", flush=True)
                ahead.clear()
                scorer.results()  # drop what was scored for the lost batch
                roles.restart()
                step, cursor = resume(roles, output, ledger)
        result.steps, result.prompts_consumed = step, cursor
        result.ledger = check_history(ledger.entries(), cfg.max_staleness)
        if eval_prompts:
            result.exact_match_after = evaluate(roles.pool, eval_prompts, cfg.max_tokens)
        refs = [w.full_weights.remote() for w in roles.policy]
        result.final_weights = ray.get(refs)[0]
        return result
    finally:
        roles.shutdown()


def save(roles: Roles, output: Path, step: int, cursor: int) -> None:
    """Checkpoint the policy (every rank) and then the cursor; the state file written last marks it complete."""
    directory = checkpoint_dir(output, step)
    ray.get([w.save.remote(str(directory)) for w in roles.policy])
    (directory / STATE_FILE).write_text(json.dumps({"step": step, "cursor": cursor}))


def resume(roles: Roles, output: Path, ledger: Ledger) -> tuple[int, int]:
    """Load the newest checkpoint into the policy and the engines (or start fresh); the ledger goes back to it.
    Returns (policy step, prompt cursor)."""
    found = latest_checkpoint(output)
    step, cursor = (found[1]["step"], found[1]["cursor"]) if found else (0, 0)
    if found:
        ray.get([w.load.remote(str(found[0])) for w in roles.policy])
        roles.sync(step)
    ledger.rewind(step)
    return step, cursor
