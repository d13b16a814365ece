"""MLflow and Prometheus for the GRPO stage: the run's params and lineage, per-update metrics, the exported policy
registered like a fine-tune (`rayline.stage: grpo`, its parent version, the prompt dataset version)."""

from __future__ import annotations

import time
from dataclasses import asdict

from core import metrics, registry
from core.config import config_hash, flatten
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.loop import StepMetrics

STAGE = "grpo"
TAG_PARENT_VERSION = "rayline.parent_version"
TAG_REWARD_MODEL = "rayline.reward_model"
"""The model version GRPO started from (`name/N`), on the run and the registered version."""
PROMETHEUS = {"reward_mean": "rayline_grpo_reward_mean", "reward_std": "rayline_grpo_reward_std",
              "kl": "rayline_grpo_kl", "rollout_tokens_per_s": "rayline_grpo_rollout_tokens_per_second",
              "weight_sync_s": "rayline_grpo_weight_sync_seconds", "policy_lag": "rayline_grpo_policy_lag",
              "prompts_consumed": "rayline_grpo_prompts_consumed", "step": "rayline_grpo_step"}


def run_tags(cfg: GrpoConfig, parent: str, dataset_version: str, reward_model: str = "") -> dict[str, str]:
    """Lineage shared by the run and the registered version (`reward_model`: the reward model that scored the samples,
    `models:/NAME/VERSION` or a path; "" with a verifier, whose name is the config's)."""
    return registry.lineage_tags(STAGE, **{
        registry.TAG_BASE_MODEL: parent, TAG_PARENT_VERSION: parent,
        registry.TAG_DATASET_VERSION: dataset_version, registry.TAG_CONFIG_HASH: config_hash(cfg),
        TAG_REWARD_MODEL: reward_model or None})


def log_params(run_id: str, cfg: GrpoConfig) -> None:
    """The flat config as the run's params (a resumed run keeps its first values, as train's does)."""
    from train.tracking import MAX_PARAM_LEN, log_new_params

    log_new_params(run_id, {k: str(v)[:MAX_PARAM_LEN] for k, v in flatten(cfg).items()})


def step_logger(run_id: str, model: str):
    """A callback for loop.run: each update's metrics to the MLflow run (step = the policy step) and to Prometheus
    (labels: the run id and the model, bounded as core/metrics.py asks)."""
    client = registry.client()

    def log(m: StepMetrics) -> None:
        from mlflow.entities import Metric

        values = {k: float(v) for k, v in asdict(m).items() if k != "step"}
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(f"grpo/{k}", v, now, m.step) for k, v in values.items()])
        for key, name in PROMETHEUS.items():
            metrics.gauge(name, float(getattr(m, key)), run=run_id, model=model)

    return log


def register(name: str, export_dir: str, run_id: str, tags: dict[str, str], steps: int) -> str:
    """Register the exported policy as a new version of `name` (a `-candidates` model: the trainer's role)."""
    mv = registry.register_checkpoint(name, export_dir, run_id=run_id, tags=tags,
                                      description=f"GRPO, {steps} policy updates")
    registry.client().set_tag(run_id, registry.TAG_MODEL_VERSION, f"{name}/{mv.version}")
    return str(mv.version)
