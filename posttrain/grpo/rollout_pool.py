"""The rollout pool: vLLM engines as Ray actors, each generating G samples per prompt and taking new policy weights in
place (weight_sync.PolicyWeightsExtension). Every sample carries the policy step of the weights that produced it.

Engines are configured as the batch stage's (serve/online/engine.py: dtype, KV cache, `uni` executor, the CPU thread
environment), so a rollout engine computes exactly as an eval engine does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from core.collector import heavy_imports
from posttrain.grpo.weight_sync import EXTENSION
from serve.online import engine as eng


@dataclass
class Sample:
    """One generation: which prompt and which of its G samples, the tokens, the text and the policy step."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finished: bool
    """The engine stopped on EOS (not on max_tokens)."""
    policy_step: int


class RolloutEngine:
    """A vLLM engine in a Ray actor (use `rollout_actor`): `generate` groups, `load_weights` from the trainer,
    `logprobs` of the next token (the sync check)."""

    def __init__(self, model_path: str, engine_cfg: eng.EngineConfig):
        eng.apply_engine_core_start()
        with heavy_imports():  # the actor's start is mostly this import (core/collector.py)
            from vllm import LLM

        self.llm = LLM(model=model_path, worker_extension_cls=EXTENSION, **eng.vllm_engine_kwargs(engine_cfg))
        self.tokenizer = self.llm.get_tokenizer()
        self.policy_step = 0

    def setup(self) -> dict[str, Any]:
        """What the engine runs with (serve/batch/engine_setup.effective_setup), read from the engine."""
        from serve.batch.engine_setup import effective_setup

        return effective_setup(self.llm.llm_engine)

    def generate(self, prompts: list[tuple[int, list[int]]], n: int, max_tokens: int, temperature: float,
                 seed: int) -> tuple[list[Sample], dict[str, float]]:
        """`n` samples of each (prompt index, token ids); returns the samples and the generation's token count and
        seconds."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed + i)
                  for i, _ in enumerate(prompts)]
        start = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        samples, tokens = [], 0
        for (index, ids), out in zip(prompts, outs):
            for j, c in enumerate(out.outputs):
                tokens += len(c.token_ids)
                samples.append(Sample(index, j, list(ids), list(c.token_ids), c.text, c.finish_reason == "stop",
                                      self.policy_step))
        return samples, {"tokens": tokens, "seconds": seconds}

    def load_weights(self, named: dict[str, Any], policy_step: int) -> float:
        """Load the trainer's weights (HF names) for `policy_step` into the running engine; returns seconds."""
        start = time.perf_counter()
        self.llm.collective_rpc("load_policy_weights", args=(named,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.policy_step = policy_step
        return time.perf_counter() - start

    def next_token_logprobs(self, prompt_ids: list[int], k: int) -> dict[int, float]:
        """The engine's log-probabilities of its `k` most likely next tokens after `prompt_ids`."""
        from vllm import SamplingParams, TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)],
                                SamplingParams(max_tokens=1, temperature=0.0, logprobs=k), use_tqdm=False)[0]
        return {tok: lp.logprob for tok, lp in out.outputs[0].logprobs[0].items()}

    def pid(self) -> int:
        return os.getpid()


def rollout_actor(model_path: str, engine_cfg: eng.EngineConfig, placement: dict[str, Any] | None = None):
    """Start one RolloutEngine actor with the engine's CPUs and runtime env (serve/engine.runtime_env);
    `placement` adds Ray scheduling options (a placement group bundle)."""
    cls = ray.remote(RolloutEngine)
    return cls.options(num_cpus=engine_cfg.cpus_per_engine, runtime_env=eng.runtime_env(engine_cfg),
                       **(placement or {})).remote(model_path, engine_cfg)


class RolloutPool:
    """`num_engines` rollout actors; a step's prompts are split across them, each group on one engine."""

    def __init__(self, model_path: str, engine_cfg: eng.EngineConfig, num_engines: int,
                 placements: list[dict[str, Any]] | None = None):
        self.model_path, self.engine_cfg = model_path, engine_cfg
        self.placements = placements or [{} for _ in range(num_engines)]
        self.actors = [rollout_actor(model_path, engine_cfg, p) for p in self.placements]

    def restart(self) -> None:
        """Replace every engine (after one was lost); the caller loads the policy's weights into them again."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = [rollout_actor(self.model_path, self.engine_cfg, p) for p in self.placements]

    def generate(self, prompts: list[tuple[int, list[int]]], n: int, max_tokens: int, temperature: float,
                 seed: int) -> list[ray.ObjectRef]:
        """One generate call per engine over its share of `prompts` (refs to (samples, stats))."""
        shares = [prompts[i::len(self.actors)] for i in range(len(self.actors))]
        return [a.generate.remote(share, n, max_tokens, temperature, seed + 7919 * i)
                for i, (a, share) in enumerate(zip(self.actors, shares)) if share]

    def load_weights(self, named_ref: ray.ObjectRef, policy_step: int) -> list[float]:
        """Every engine loads the weights at `named_ref` (one object in Ray's store, read by each); seconds each."""
        return ray.get([a.load_weights.remote(named_ref, policy_step) for a in self.actors])
