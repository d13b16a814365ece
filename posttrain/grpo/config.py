"""The GRPO stage's typed config (`configs/post_train/grpo_*.yaml` mirrors it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import require
from serve.online.engine import EngineConfig
from train.config import LoraConfig


@dataclass
class PromptsConfig:
    uri: str
    """Chat JSONL (the sample corpus's shape: `messages` ending with the reference answer as the assistant's)."""
    dataset_version: str = ""
    """The prompt dataset's version, recorded on the run and the registered version ("" = the file's sha256)."""
    tasks: list[str] = field(default_factory=list)
    """Only records whose `task` is listed ([] = all)."""
    limit: int = 0
    """Use the first `limit` records (0 = all)."""


MODEL_REWARD = "model"
"""`reward.name` that scores with a reward model served by an engine pool instead of a verifier."""


@dataclass
class RewardConfig:
    name: str = "exact_answer"
    """A verifier in posttrain/grpo/rewards.py REWARDS, or `model`: the score of `model` served by an engine pool."""
    model: str = ""
    """`name: model`: the reward model (`models:/name@alias`, `models:/name/N` or a checkpoint directory), a
    `*ForSequenceClassification` checkpoint with one label; a completion's reward is its score of the rendered prompt
    followed by the completion (posttrain/grpo/reward_pool.py)."""
    num_engines: int = 1
    """`name: model`: engines serving the reward model (each a Ray actor with `engine.cpus_per_engine` CPUs of its own,
    outside the roles' placement group)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="reward", cpus_per_engine=0.2))
    """`name: model`: the reward engines' settings (`engine.model` is ignored: they load `reward.model`)."""
    max_in_flight: int = 4
    """Reward tasks pending at once; generation waits for one to finish beyond that (backpressure)."""
    chunk: int = 8
    """Groups scored per reward task."""
    delay_s: float = 0.0
    """Seconds each reward task waits before scoring (stands in for a slow verifier; tests and benches)."""


@dataclass
class PolicyConfig:
    num_workers: int = 1
    """Ranks of the policy's FSDP2 group."""
    cpus_per_worker: float = 1.0
    """Ray CPUs each rank reserves (fractional when colocated: the roles take turns on the same cores)."""
    threads: int = 0
    """torch compute threads per rank (0 = floor of cpus_per_worker, at least 1)."""
    lr: float = 5.0e-5
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    beta: float = 0.0
    """Weight of the KL-to-reference term (0: off, no reference model kept; TRL's default too)."""
    micro_batch: int = 32
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`lora.enabled`: train a LoRA adapter on the frozen start model (train/'s `lora` section) instead of every weight;
    the engines get, and the export holds, the start's weights with the adapter folded in (a full checkpoint)."""


@dataclass
class GrpoConfig:
    model: str
    """The policy's start (and the reference): `models:/name@alias`, `models:/name/N` or a checkpoint directory."""
    prompts: PromptsConfig
    output_uri: str
    """Checkpoints (`checkpoints/step_N`), the sample ledger and the exported model go here."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="policy"))
    """The rollout engines' settings (`engine.model` is ignored: the engines load the policy)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    eval_uri: str = ""
    """Chat JSONL scored by exact match (greedy, the batch eval's scorer) before the first and after the last update
    ("" = no eval)."""
    eval_limit: int = 0
    """Score the first `eval_limit` eval records (0 = all)."""
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8
    """G: samples per prompt."""
    max_tokens: int = 8
    temperature: float = 1.0
    num_engines: int = 1
    placement: Literal["colocated", "separate"] = "colocated"
    """`colocated`: rollout and training time-share the same CPUs (rollout, then train, then sync); `separate`: a
    placement group gives the engines and the policy bundles of their own (needs their CPUs free at once)."""
    max_staleness: int = 0
    """Policy steps a batch's samples may lag the policy that trains on them (0: every batch is sampled by the
    current policy)."""
    checkpoint_every: int = 5
    """Steps between checkpoints (0: only at the end)."""
    max_restarts: int = 2
    """Times the run resumes from its last checkpoint after losing a rollout engine or a policy worker."""
    seed: int = 0
    run_name: str = ""
    mlflow_experiment: str = "rayline-train"
    """The run's experiment ("" = no MLflow run, nothing registered: a local try-out)."""
    register_as: str = ""
    """`<model>-candidates` to register the result into as the trainer ("" = do not register)."""

    def __post_init__(self) -> None:
        require(self.steps >= 1, "steps", f"must be at least 1, got {self.steps}")
        require(self.group_size >= 2, "group_size", f"must be at least 2 (advantages compare a group), got {self.group_size}")
        require(self.prompts_per_step >= 1, "prompts_per_step", f"must be at least 1, got {self.prompts_per_step}")
        require(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        require(self.temperature > 0, "temperature", f"must be > 0 (GRPO needs different samples), got {self.temperature}")
        require(self.num_engines >= 1, "num_engines", f"must be at least 1, got {self.num_engines}")
        require(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        require(self.policy.num_workers >= 1, "policy.num_workers", f"must be at least 1, got {self.policy.num_workers}")
        require(self.reward.max_in_flight >= 1, "reward.max_in_flight", f"must be at least 1, got {self.reward.max_in_flight}")
        from posttrain.grpo.rewards import REWARDS

        require(self.reward.name in REWARDS or self.reward.name == MODEL_REWARD, "reward.name",
                f"{self.reward.name!r} is not a known reward (known: {', '.join(sorted(REWARDS))}, or "
                f"{MODEL_REWARD} with reward.model)")
        if self.reward.name == MODEL_REWARD:
            require(bool(self.reward.model.strip()), "reward.model",
                    "name the reward model (models:/name@alias, models:/name/N or a checkpoint directory)")
            require(self.reward.num_engines >= 1, "reward.num_engines", f"must be at least 1, got {self.reward.num_engines}")
        else:
            require(not self.reward.model, "reward.model",
                    f"is set but reward.name is {self.reward.name!r}: set reward.name: {MODEL_REWARD} to score with it")
