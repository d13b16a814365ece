"""A Ray Tune search over DPO settings (beta, learning rate, LoRA, ...): the tune stage's machinery (train/tune.py),
each trial a DPO run over one preference version scored once.

    python -m pipelines.tune --config configs/tune/dpo_tiny.yaml

1. On the driver, before the search: the DPO stage's steps 1-2 (posttrain/dpo_stage.py `prepare_scored_version`):
   the preference version and the reference's log-probs of it, each skipped when it exists. No trial prepares or
   scores anything: every trial trains on that one scored version.
2. The search (train/tune.py `main` with `DpoTrials`): each trial is the DPO config with its sampled values, trained
   on the train stage's TorchTrainer with `DpoObjective(its beta)`; its MLflow child run carries the DPO lineage tags
   (reference, digest, preference version, the pairs' lineage) and its own `rayline.dpo_beta`. ASHA and the best
   trial rank on `metric`: for a search over beta a beta-free one (posttrain/tune_config.py).
3. The best finished trial registers like a DPO run: `rayline.stage: dpo` and the same lineage tags, plus the
   search's (`rayline.tune_search`, `rayline.tune_trial`, `rayline.tune_metric`, ...).
"""

from __future__ import annotations

from dataclasses import replace

from core import storage
from posttrain.dpo_config import DpoConfig
from posttrain.dpo_loss import DpoObjective
from posttrain.dpo_stage import STAGE, TAG_DPO_BETA, ScoredVersion, plan_dpo_run, prepare_scored_version
from posttrain.tune_config import PostTrainTuneConfig
from train.config import TrainConfig
from train.preflight import RunPlan
from train.tune import TrialRecipe, TuneResult, max_concurrent_trials
from train.tune import main as run_search
from train.tune_config import trial_config, with_values


class DpoTrials(TrialRecipe):
    """Trials of a DPO config over one scored preference version: each its own DpoConfig (the sampled `dpo.*` and
    shared fields set), its own beta in the objective and the tags."""

    stage = STAGE

    def __init__(self, base: DpoConfig, scored: ScoredVersion):
        super().__init__(base.train_config(scored.scored_manifest_uri))
        self.dpo_base, self.scored = base, scored

    def dpo_config(self, sampled: dict) -> DpoConfig:
        return with_values(self.dpo_base, sampled, "DPO trial")

    def train_config(self, sampled: dict, run_name: str, storage_path: str | None = None,
                     experiment: str | None = None, resources_per_worker: dict[str, float] | None = None) -> TrainConfig:
        trained = self.dpo_config(sampled).train_config(self.scored.scored_manifest_uri)
        return trial_config(trained, {}, run_name, storage_path, experiment, resources_per_worker)

    def plan(self, train_cfg: TrainConfig, cluster: dict[str, float]) -> RunPlan:
        return plan_dpo_run(train_cfg, cluster)

    def objective(self, sampled: dict) -> DpoObjective:
        return DpoObjective(self.dpo_config(sampled).dpo.beta)

    def lineage_tags(self) -> dict[str, str]:
        return self.scored.lineage_tags()

    def trial_tags(self, sampled: dict) -> dict[str, str]:
        return {TAG_DPO_BETA: str(self.dpo_config(sampled).dpo.beta)}


def main(cfg: PostTrainTuneConfig) -> TuneResult:
    """Score the DPO base's preference version once, then run the search over it; register the best finished trial.
    ConfigError (before any trial starts) if the search cannot run."""
    import ray

    from train.trainer import connect_ray

    if not cfg.post_train_config:
        raise ValueError("posttrain.dpo_tune.main: the search's base is not a post-training config "
                         "(a train_config search is train.tune.main's)")
    connect_ray()
    max_concurrent_trials(cfg, ray.cluster_resources())  # a search that cannot fit is refused before the scoring pass
    base = cfg.base_config()
    scored = prepare_scored_version(base)
    if not storage.is_remote(scored.scored_manifest_uri):
        # Tune runs each trial in a working directory of its own: a relative path would not reach the version there.
        scored = replace(scored, scored_manifest_uri=storage.resolve(scored.scored_manifest_uri)[1])
    return run_search(cfg, DpoTrials(base, scored))
