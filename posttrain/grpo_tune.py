"""A Ray Tune search over GRPO settings (learning rate, group size, KL weight, temperature, ...): each trial a GRPO
run of its own, ASHA stopping the trials whose reward lags.

    python -m pipelines.tune --config configs/tune/grpo_tiny.yaml

1. On the driver: the GRPO base config (`post_train_config` with its overrides), its paths made absolute (Tune runs
   each trial in a working directory of its own), and how many trials fit at once: each trial holds its rollout
   engines' and policy ranks' CPUs (a placement group, posttrain/grpo/placement.py) besides its own trial driver.
2. The search: each trial is a Tune function trainable that runs the GRPO stage (posttrain/grpo/stage.py) with the
   sampled values as an MLflow child run of the search's run (`rayline.stage: tune-trial`), reporting `step` and
   `reward_mean` after every update but the last, and after its export the last update's figures with the export's
   path. ASHA compares trials on `reward_mean` at its rungs (the last rung below a trial's last update, so a trial that
   gets there always exports). A stopped trial's engines and policy ranks go with its trial actor (Ray ends the
   actors a process owned when it ends).
3. The best finished trial's export registers like a GRPO run: `rayline.stage: grpo`, the trial's lineage (its start,
   the prompts' version, its config hash), plus the search's tags (`rayline.tune_search`, `rayline.tune_trial`,
   `rayline.tune_metric`, ...); the whole search's CPU-seconds go on the search's run and that version.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

from core import registry, storage, usage
from core.config import ConfigError
from posttrain.grpo import tracking as grpo_tracking
from posttrain.grpo.config import GrpoConfig
from posttrain.tune_config import PostTrainTuneConfig
from train.capacity import TRIAL_DRIVER_CPUS
from train.tracking import record_usage
from train.trainer import connect_ray, worker_env
from train.tune import (
    TAG_TUNE_METRIC, TAG_TUNE_PARENT, TAG_TUNE_SEARCH, TAG_TUNE_TRIAL, TuneResult, best_trial, describe_search,
    run_search, trial_summaries,
)
from train.tune_config import TRIAL_SAFE, with_values

LINEAGE = (registry.TAG_BASE_MODEL, grpo_tracking.TAG_PARENT_VERSION, registry.TAG_DATASET_VERSION,
           registry.TAG_CONFIG_HASH, grpo_tracking.TAG_REWARD_MODEL)
"""The trial run's tags its registered version carries (posttrain/grpo/tracking.py run_tags)."""


def trial_cpus(base: GrpoConfig) -> float:
    """CPUs one trial holds: its engines, its policy ranks and its trial driver."""
    return (base.num_engines * base.engine.cpus_per_engine + base.policy.num_workers * base.policy.cpus_per_worker
            + TRIAL_DRIVER_CPUS)


def max_concurrent_trials(cfg: PostTrainTuneConfig, base: GrpoConfig, cluster: dict[str, float]) -> tuple[int, str]:
    """Trials that may run at once, and the arithmetic; ConfigError when the search cannot run as asked."""
    cpus, each = float(cluster.get("CPU", 0)), trial_cpus(base)
    fit = math.floor(cpus / each + 1e-9)
    what = (f"{cpus:g} CPUs / ({base.num_engines} engine(s) x {base.engine.cpus_per_engine:g} + "
            f"{base.policy.num_workers} rank(s) x {base.policy.cpus_per_worker:g} + trial driver {TRIAL_DRIVER_CPUS:g}"
            f" = {each:g} a trial) = {fit}")
    if fit < 1:
        raise ConfigError(f"post_train_config: not even one GRPO trial fits, so the search is refused: {what} "
                          f"({cfg.base_config_path()})")
    if cfg.max_concurrent_trials > fit:
        raise ConfigError(f"max_concurrent_trials: {cfg.max_concurrent_trials} concurrent trials do not fit: {what}")
    n = min(cfg.max_concurrent_trials or fit, cfg.num_samples)
    return n, f"{what}; {n} at a time"


def absolute_paths(base: GrpoConfig) -> GrpoConfig:
    """`base` with its local paths absolute: Tune runs each trial in a working directory of its own."""
    def fix(p: str) -> str:
        return p if not p or storage.is_remote(p) or p.startswith("models:/") else str(Path(p).resolve())
    return replace(base, model=fix(base.model), output_uri=fix(base.output_uri), eval_uri=fix(base.eval_uri),
                   prompts=replace(base.prompts, uri=fix(base.prompts.uri)))


def trial_config(base: GrpoConfig, sampled: dict, run_name: str, search_name: str, experiment: str) -> GrpoConfig:
    """The GrpoConfig of one trial: `base` with the sampled values, its own run name and output, no registration."""
    fixed = {"run_name": TRIAL_SAFE.sub("-", run_name), "register_as": "", "mlflow_experiment": experiment,
             "output_uri": storage.join(base.output_uri, search_name)}
    return with_values(base, {**fixed, **sampled}, f"GRPO trial {run_name}")


def run_trial(config: dict, cfg: PostTrainTuneConfig, base: GrpoConfig, parent_run_id: str,
              env: dict[str, str]) -> None:
    """Tune function trainable: one trial = one GRPO stage run under the search's parent MLflow run."""
    from ray import tune

    from posttrain.grpo import stage

    os.environ.update(env)  # the driver's MLflow and S3 settings: Tune, not our driver, starts the trial actors
    trial_id = tune.get_context().get_trial_id()
    sampled = {k: config[k] for k in cfg.space}
    trial_cfg = trial_config(base, sampled, f"{cfg.search_name}-{trial_id}", cfg.search_name, cfg.experiment)
    tags = {registry.TAG_STAGE: "tune-trial", TAG_TUNE_SEARCH: cfg.search_name, TAG_TUNE_TRIAL: trial_id,
            TAG_TUNE_PARENT: parent_run_id}

    def report(m) -> None:
        if m.step < trial_cfg.steps:  # the last update is reported with the export below
            tune.report({"step": m.step, "reward_mean": m.reward_mean, "reward_std": m.reward_std, "kl": m.kl})

    result = stage.main(trial_cfg, after_update=report, parent_run_id=parent_run_id, extra_tags=tags)
    tune.report({"step": result.steps, "reward_mean": result.reward_last, "export_uri": result.export_dir,
                 "exact_match_after": result.exact_match_after if result.exact_match_after is not None else math.nan})


def main(cfg: PostTrainTuneConfig) -> TuneResult:
    """Run the search; register the best finished trial. ConfigError (before any trial starts) if it cannot run."""
    import ray
    from ray import tune

    if cfg.post_train_stage() != "grpo":
        raise ValueError("posttrain.grpo_tune.main: the search's base is not a GRPO config")
    base = absolute_paths(cfg.base_config())
    connect_ray()
    meter = usage.StageUsage.start()  # every trial (its engines and policy ranks) is this job's
    concurrent, arithmetic = max_concurrent_trials(cfg, base, ray.cluster_resources())
    # ASHA puts its last rung at max_t; one update short of a trial's end keeps every rung before the final report.
    max_t = min(cfg.asha.max_t or base.steps, base.steps - 1)
    register_as = cfg.register_as or base.register_as
    tags = registry.lineage_tags("tune", **{TAG_TUNE_SEARCH: cfg.search_name, registry.TAG_BASE_MODEL: base.model,
                                            registry.TAG_DATASET_VERSION: base.prompts.dataset_version or None})
    with registry.start_run(cfg.experiment, cfg.search_name, tags=tags) as parent:
        parent_id = parent.info.run_id
        client = registry.client()
        describe_search(cfg, parent_id, concurrent, arithmetic, "GRPO trials")
        trainable = tune.with_parameters(run_trial, cfg=cfg, base=base, parent_run_id=parent_id, env=worker_env())
        grid = run_search(cfg, trainable, concurrent, max_t, storage.join(base.output_uri, cfg.search_name))
        result = TuneResult(cfg.search_name, parent_id, concurrent, arithmetic)
        result.trials = trial_summaries(cfg, grid, parent_id, base.steps)
        result.best = best_trial(cfg, result.trials, parent_id)
        registered = None
        trial_tags = client.get_run(result.best.mlflow_run_id).data.tags if result.best.mlflow_run_id else {}
        if register_as and trial_tags:
            version_tags = {**{k: trial_tags[k] for k in LINEAGE if k in trial_tags},
                            **registry.lineage_tags(grpo_tracking.STAGE), TAG_TUNE_SEARCH: cfg.search_name,
                            TAG_TUNE_PARENT: parent_id, TAG_TUNE_TRIAL: result.best.trial_id,
                            TAG_TUNE_METRIC: f"{cfg.metric}={result.best.metric:.6g}"}
            version = grpo_tracking.register(register_as, result.best.export_uri, result.best.mlflow_run_id,
                                             version_tags, result.best.step)
            registered = (register_as, version)
            result.model_name, result.model_version = registered
            client.set_tag(parent_id, "rayline.model_version", f"{register_as}/{version}")
        # What building the start cost comes with the version (the trial resolved an alias to `models:/NAME/N`).
        result.usage = record_usage("tune", meter, parent_id, registered, None,
                                    parent=trial_tags.get(grpo_tracking.TAG_PARENT_VERSION, ""))
    return result
