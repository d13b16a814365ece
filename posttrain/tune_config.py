"""The tune stage's config as `python -m pipelines.tune` loads it: train/tune_config.py's `TuneConfig`, whose base may
also be a post-training config. `configs/tune/*.yaml` mirrors `PostTrainTuneConfig`.

A search starts from exactly one of `train_config` (a fine-tune's YAML, overridden by `train_overrides`) or
`post_train_config` (a DPO or a GRPO YAML, configs/post_train/*.yaml, overridden by `post_train_overrides`; which of
the two it is, its sections say: a GRPO config has `prompts`, a DPO config `dpo`); its `space` names dotted fields of
that config. For DPO: `dpo.beta` and the sections it shares with the train stage (`optim.lr`, `lora.rank`,
`train.grad_accum_steps`, ...). What the preference version and the reference's log-probs are made from
(`preferences.*`, `model.path`, the `dpo.reference*` fields, `dpo.from_eval_run`) is fixed for the search: they
are computed once, before it, for all of its trials (posttrain/dpo_tune.py). For GRPO: `policy.lr`, `group_size`,
`policy.beta`, `temperature`, `prompts_per_step`, ...; the start (`model`) and the prompts are the search's, the same
for every trial (posttrain/grpo_tune.py). GRPO trials report `reward_mean` (the verifier's mean reward of the step's
samples; mode max) after every update.

Ranking DPO trials: `eval_loss` is each trial's DPO loss at its own beta, which is not comparable across betas, so a
search over `dpo.beta` must rank on a beta-free measure every DPO evaluation reports (posttrain/dpo_loss.py):
`eval_preference_accuracy` (share of eval pairs whose log-ratio margin is above 0; mode max) or
`eval_logratio_margin` (the margin's mean in nats; mode max).

This class lives in posttrain/ because it loads DPO configs; train/ may not import the post-training stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from core.config import ConfigError, load_config, require
from posttrain.dpo_config import DpoConfig
from posttrain.grpo.config import GrpoConfig
from train.config import TrainConfig
from train.tune_config import PER_TRIAL, TuneConfig, project_path

SCORED_ONCE = ("the preference version and the reference's log-probs are computed once, before the search, for "
               "every trial: set it in post_train_config or post_train_overrides")
DPO_EVAL_METRICS = {"eval_preference_accuracy": "max", "eval_logratio_margin": "max"}
GRPO_METRICS = {"reward_mean": "max"}
GRPO_SHARED = "every trial starts from the same policy and prompts (the search's lineage): set it in post_train_config"
PLACEHOLDER_MANIFEST = "<the scored preference version>"
"""Stands for the scored version's manifest in a DPO base's TrainConfig before it exists (sizing, rendering)."""


@dataclass
class PostTrainTuneConfig(TuneConfig):
    post_train_config: str = ""
    """A DPO or GRPO YAML every trial starts from instead of `train_config` (relative paths as `train_config`'s)."""
    post_train_overrides: list[str] = field(default_factory=list)
    """key=value overrides applied to `post_train_config` before sampling."""

    def post_train_stage(self) -> str:
        """`dpo` or `grpo`: the stage whose config `post_train_config` is ("" without one), by its sections."""
        if not self.post_train_config:
            return ""
        path = self.base_config_path()
        if not path.is_file():
            raise ConfigError(f"post_train_config: {path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"post_train_config: cannot read {path}: {e}") from None
        sections = set(data) if isinstance(data, dict) else set()
        if "prompts" in sections:
            return "grpo"
        if "dpo" in sections or "preferences" in sections:
            return "dpo"
        raise ConfigError(f"post_train_config: {path} is neither a DPO config (a `dpo` section) nor a GRPO config "
                          "(a `prompts` section)")

    def check_base_fields(self) -> None:
        both = bool(self.train_config) and bool(self.post_train_config)
        require(not both, "post_train_config", f"a search starts from one config: train_config ({self.train_config}) "
                                               f"or post_train_config ({self.post_train_config}), not both")
        require(bool(self.train_config or self.post_train_config), "train_config",
                "name the config every trial starts from: train_config (a train YAML) or post_train_config (a DPO "
                "or GRPO YAML)")
        if not self.post_train_config:
            require(not self.post_train_overrides, "post_train_overrides",
                    "applies to post_train_config, which is not set (overrides of train_config go in train_overrides)")
            return
        require(not self.train_overrides, "train_overrides",
                "applies to train_config; overrides of post_train_config go in post_train_overrides")
        # The loss at one beta is not the loss at another: ranking trials of different betas on it would pick the
        # largest beta whatever the policy learned.
        require(self.metric not in ("eval_loss", "loss") or "dpo.beta" not in self.space, "metric",
                f"{self.metric} is the DPO loss at each trial's own beta, not comparable across the betas `space` "
                f"samples: rank on {' or '.join(DPO_EVAL_METRICS)} (mode: max)")

    def metrics(self) -> dict[str, str]:
        stage = self.post_train_stage()
        if stage == "grpo":
            return dict(GRPO_METRICS)
        return {**super().metrics(), **(DPO_EVAL_METRICS if stage == "dpo" else {})}

    def fixed_fields(self) -> dict[str, str]:
        stage = self.post_train_stage()
        if stage == "grpo":
            return {**{k: PER_TRIAL for k in ("run_name", "output_uri", "mlflow_experiment", "register_as")},
                    **{k: GRPO_SHARED for k in ("model", "prompts.", "eval_uri", "eval_limit")}}
        scored = ("preferences.", "model.path", "dpo.reference", "dpo.reference_batch_size", "dpo.reference_gpus",
                  "dpo.from_eval_run")
        return {**super().fixed_fields(), **({k: SCORED_ONCE for k in scored} if stage == "dpo" else {})}

    def check_base(self, base) -> None:
        if not isinstance(base, GrpoConfig):
            return super().check_base(base)
        # ASHA's last rung stays below a trial's last update (posttrain/grpo_tune.py), so the grace period must too.
        require(self.asha.grace_period < base.steps, "asha.grace_period",
                f"{self.asha.grace_period} steps leaves no rung before the end of a {base.steps}-step GRPO trial")

    def base_what(self) -> str:
        return {"grpo": "GRPO config", "dpo": "DPO config"}.get(self.post_train_stage(), super().base_what())

    def overrides_field(self) -> str:
        return "post_train_overrides" if self.post_train_config else super().overrides_field()

    def base_config_path(self) -> Path:
        return project_path(self.post_train_config) if self.post_train_config else super().base_config_path()

    def base_config(self) -> DpoConfig | GrpoConfig | TrainConfig:
        if not self.post_train_config:
            return super().base_config()
        cls = GrpoConfig if self.post_train_stage() == "grpo" else DpoConfig
        try:
            return load_config(cls, self.base_config_path(), self.post_train_overrides)
        except ConfigError as e:
            raise ConfigError(f"post_train_config: {e}") from None

    def base_train_config(self) -> TrainConfig:
        """For a DPO base, its TrainConfig over a placeholder manifest: the scaling and loop a trial runs with (the
        manifest is the scored preference version, known once the search has made it)."""
        if not self.post_train_config:
            return super().base_train_config()
        if self.post_train_stage() == "grpo":
            raise ConfigError("post_train_config: a GRPO search's trials run the GRPO loop, not the train stage's "
                              "TorchTrainer (posttrain/grpo_tune.py sizes them)")
        return self.base_config().train_config(PLACEHOLDER_MANIFEST)
