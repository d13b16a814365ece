"""A reward model served by a pool of vLLM engines (`reward.name: model`): each engine a Ray actor running a
`*ForSequenceClassification` checkpoint with one label on vLLM's pooling runner; a completion's reward is the model's
score (its logit, no activation) of the rendered prompt followed by the completion, read with the reward model's own
tokenizer. The engines are configured as the rollout engines are (serve/online/engine.py: dtype, KV cache, `uni`
executor, the CPU thread environment)."""

from __future__ import annotations

import json
from pathlib import Path
import ray

from core.collector import heavy_imports
from serve.online import engine as eng


def check_reward_model(model_dir: str) -> None:
    """A reward model is a sequence classifier with one label; anything else is named before an engine starts."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if not any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs) or labels != 1:
        raise ValueError(f"reward.model: {model_dir} is {archs or 'an unnamed architecture'} with {labels} label(s); a "
                         "reward model is a *ForSequenceClassification checkpoint with one label (num_labels: 1)")


class RewardEngine:
    """A vLLM pooling engine in a Ray actor (use `reward_actor`): `score` texts."""

    def __init__(self, model_path: str, engine_cfg: eng.EngineConfig):
        eng.apply_engine_core_start()
        with heavy_imports():
            from vllm import LLM

        self.llm = LLM(model=model_path, runner="pooling", **eng.vllm_engine_kwargs(engine_cfg))
        self.tokenizer = self.llm.get_tokenizer()

    def score(self, texts: list[str]) -> list[float]:
        """The model's score of each text (tokenized as written: the chat template's markers are in the text)."""
        from vllm import PoolingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer(t, add_special_tokens=False)["input_ids"])
                   for t in texts]
        outs = self.llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return [float(o.outputs.probs[0]) for o in outs]

    def pid(self) -> int:
        import os

        return os.getpid()


def reward_actor(model_path: str, engine_cfg: eng.EngineConfig):
    """One RewardEngine actor with its engine's CPUs, outside any placement group its caller runs in (a Tune trial's)."""
    cls = ray.remote(RewardEngine)
    return cls.options(num_cpus=engine_cfg.cpus_per_engine, runtime_env=eng.runtime_env(engine_cfg),
                       scheduling_strategy="DEFAULT").remote(model_path, engine_cfg)


class RewardPool:
    """`num_engines` reward engines; chunks of texts go to them in turn."""

    def __init__(self, model_path: str, engine_cfg: eng.EngineConfig, num_engines: int):
        check_reward_model(model_path)
        self.model_path, self.engine_cfg, self.num_engines = model_path, engine_cfg, num_engines
        self.actors = [reward_actor(model_path, engine_cfg) for _ in range(num_engines)]
        self._next = 0

    def score(self, texts: list[str]) -> ray.ObjectRef:
        """One engine's scores of `texts` (a ref to the list)."""
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        return actor.score.remote(texts)

    def restart(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = [reward_actor(self.model_path, self.engine_cfg) for _ in range(self.num_engines)]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
