"""The tune stage: a Ray Tune search (ASHA) over the train stage's own training function.

    python -m pipelines.tune --config configs/tune/tiny.yaml

Each trial is a Tune function trainable that builds the same TorchTrainer the train stage uses and
calls `fit()`; rank 0's reports reach Tune through `TuneReportCallback`, so ASHA sees `step` and
`eval_loss` at every checkpoint. Trials run as MLflow child runs of one parent run named after the
search; the best finished trial's export is registered as a model version tagged with the search.
Trial runs live in `<checkpoint.storage_path>/<search_name>/<search_name>-<trial id>/`.

What a trial trains is a `TrialRecipe`: here the train stage's (the base TrainConfig with the sampled values, the
next-token loss); a search over a post-training config passes its own to `main` (posttrain/dpo_tune.py: DPO over a
preference version scored once on the driver, each trial with its own beta). train/ never imports posttrain/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from core import registry, storage, usage
from core.config import ConfigError, flatten
from core.resource_wait import ResourceWatch
from core.usage import Usage
from train.capacity import TRIAL_DRIVER_CPUS, runs_that_fit
from train.config import TrainConfig
from train.preflight import RunPlan, plan_run
from train.tracking import MAX_PARAM_LEN, log_new_params, record_usage, register_export, training_run
from train.trainer import build_trainer, connect_ray, worker_env
from train.tune_config import TuneConfig, trial_config

TAG_TUNE_SEARCH = "rayline.tune_search"
TAG_TUNE_TRIAL = "rayline.tune_trial"
TAG_TUNE_PARENT = "rayline.tune_parent_run"
TAG_TUNE_METRIC = "rayline.tune_metric"


@dataclass
class TrialSummary:
    trial_id: str
    run_name: str
    mlflow_run_id: str | None
    sampled: dict
    step: int
    metric: float | None
    finished: bool
    """Ran every planned step and exported (ASHA-stopped trials did not)."""
    export_uri: str = ""
    """Where the trial's final export was written (a fresh directory per export: never overwritten)."""


@dataclass
class TuneResult:
    search_name: str
    parent_run_id: str
    max_concurrent_trials: int
    capacity: str
    """The arithmetic behind max_concurrent_trials."""
    trials: list[TrialSummary] = field(default_factory=list)
    best: TrialSummary | None = None
    model_name: str | None = None
    model_version: str | None = None
    lineage: dict = field(default_factory=dict)
    """What every trial shared beside the dataset (a DPO search: the reference and the preference version)."""
    usage: Usage | None = None
    """CPU- and GPU-seconds of the whole search: every trial, stopped and failed ones too (core/usage.py)."""


class TrialRecipe:
    """What each trial of a search trains, and the tags its runs and the registered best carry. This one is the train
    stage's: the base TrainConfig with the trial's sampled values, on the next-token loss. A post-training search
    subclasses it (posttrain/dpo_tune.py). It travels to the trial actors pickled: it holds configs and strings."""

    stage = "train"
    """`rayline.stage` of the registered best trial's version (the search's run is `tune`, a trial's `tune-trial`)."""

    def __init__(self, base: TrainConfig):
        self.base = base
        """The train config of the search's base, before sampling: what sizes and plans the trials."""

    def train_config(self, sampled: dict, run_name: str, storage_path: str | None = None,
                     experiment: str | None = None, resources_per_worker: dict[str, float] | None = None) -> TrainConfig:
        """The TrainConfig of the trial that sampled `sampled` (see train.tune_config.trial_config)."""
        return trial_config(self.base, sampled, run_name, storage_path, experiment, resources_per_worker)

    def plan(self, train_cfg: TrainConfig, cluster: dict[str, float]) -> RunPlan:
        return plan_run(train_cfg, cluster)

    def objective(self, sampled: dict):
        """The trial's train.loop.Objective; None = next-token cross-entropy."""
        return None

    def lineage_tags(self) -> dict[str, str]:
        """Tags the search's run, every trial's run and the registered version carry beside the train stage's."""
        return {}

    def trial_tags(self, sampled: dict) -> dict[str, str]:
        """Tags of one trial's run and, for the best, its version: what that trial trained with of its own."""
        return {}


def trial_resources(cfg: TuneConfig, cluster: dict[str, float]) -> dict[str, float]:
    """Per-worker resources of every trial, fixed once on the driver (the trial driver's CPU left out of the share)."""
    base = cfg.base_train_config()
    return base.scaling.worker_resources(float(cluster.get("CPU", 0)), TRIAL_DRIVER_CPUS)


def max_concurrent_trials(cfg: TuneConfig, cluster: dict[str, float]) -> tuple[int, str]:
    """Trials that may run at once, and the arithmetic; ConfigError when the search cannot run as asked."""
    base = cfg.base_train_config()
    resources = trial_resources(cfg, cluster)
    fit = runs_that_fit(cluster, base.scaling.num_workers, resources, base.scaling.data_cpus, TRIAL_DRIVER_CPUS)
    if fit.runs < 1 or resources.get("CPU", 1) <= 0:
        raise ConfigError(f"scaling.resources_per_worker: not even one trial fits, so the search is refused: "
                          f"{fit.explain(1)} ({cfg.base_config_path()})")
    if cfg.max_concurrent_trials > fit.runs:
        raise ConfigError(f"max_concurrent_trials: {cfg.max_concurrent_trials} concurrent trials do not fit, "
                          f"at most {fit.runs} do: {fit.explain(cfg.max_concurrent_trials)}")
    n = min(cfg.max_concurrent_trials or fit.runs, cfg.num_samples)
    return n, fit.explain(n)


def run_trial(config: dict, cfg: TuneConfig, recipe: TrialRecipe, parent_run_id: str, env: dict[str, str],
              resources_per_worker: dict[str, float]) -> None:
    """Tune function trainable: one trial = one train-stage run (of `recipe`) under the search's parent MLflow run.

    `config` holds the sampled values; the rest comes through `tune.with_parameters`, which keeps the
    environment (S3 credentials) out of the trial configs Tune writes to storage.
    """
    import ray
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    # Trial actors are started by Tune, not by our driver: give them the driver's MLflow and S3 settings.
    os.environ.update(env)
    trial_id = tune.get_context().get_trial_id()
    sampled = {k: config[k] for k in cfg.space}
    train_cfg = recipe.train_config(sampled, f"{cfg.search_name}-{trial_id}",
                                    storage.join(recipe.base.checkpoint.storage_path, cfg.search_name), cfg.experiment,
                                    resources_per_worker)
    plan = recipe.plan(train_cfg, ray.cluster_resources())
    tags = {**recipe.lineage_tags(), **recipe.trial_tags(sampled),
            TAG_TUNE_SEARCH: cfg.search_name, TAG_TUNE_TRIAL: trial_id, TAG_TUNE_PARENT: parent_run_id}
    with training_run(train_cfg, plan, parent_run_id=parent_run_id, extra_tags=tags) as run_id:
        build_trainer(train_cfg, plan, run_id, callbacks=[TuneReportCallback()],
                      objective=recipe.objective(sampled)).fit()


def trial_summaries(cfg: TuneConfig, results, parent_run_id: str, total_steps: int) -> list[TrialSummary]:
    """Each trial's figures (its last report) and MLflow child run; a trial ASHA stopped gets its run closed KILLED
    with the step it stopped at. A trial is finished when it reported `export_uri` at `total_steps`."""
    client = registry.client()
    exp = client.get_experiment_by_name(cfg.experiment)
    children = client.search_runs([exp.experiment_id], f"tags.`{TAG_TUNE_PARENT}` = '{parent_run_id}'") if exp else []
    by_trial = {r.data.tags.get(TAG_TUNE_TRIAL): r for r in children}
    out = []
    for res in results:
        metrics = res.metrics or {}
        trial_id = metrics.get("trial_id", "unknown")  # Tune adds it to every reported result
        run = by_trial.get(trial_id)
        step = int(metrics.get("step", 0))
        out.append(TrialSummary(
            trial_id=trial_id, run_name=run.info.run_name if run else "",
            mlflow_run_id=run.info.run_id if run else None,
            sampled={k: res.config.get(k) for k in cfg.space}, step=step, metric=metrics.get(cfg.metric),
            finished=bool(metrics.get("export_uri")) and step >= total_steps, export_uri=metrics.get("export_uri") or "",
        ))
        stopped = not out[-1].finished and getattr(res, "error", None) is None
        if run and (run.info.status == "RUNNING" or (stopped and run.info.status == "FAILED")):
            # ASHA stops a trial by ending its actor: its child run either never closed itself (RUNNING) or,
            # when the stop reached the trial function as an exception first, closed itself FAILED. Either
            # way Tune reports no error for it; a trial that really failed keeps FAILED.
            client.set_tag(run.info.run_id, "rayline.tune_stopped_at_step", str(step))
            client.set_terminated(run.info.run_id, "KILLED")
    return out


def best_trial(cfg: TuneConfig, trials: list[TrialSummary], parent_run_id: str) -> TrialSummary:
    """The finished trial with the best metric, recorded on the search's run; RuntimeError when none finished."""
    finished = [t for t in trials if t.finished and t.metric is not None and t.metric == t.metric]
    if not finished:
        raise RuntimeError(f"search {cfg.search_name}: no trial finished (see MLflow parent run {parent_run_id})")
    sign = 1 if cfg.mode == "min" else -1
    best = min(finished, key=lambda t: sign * t.metric)
    client = registry.client()
    client.log_metric(parent_run_id, f"best_{cfg.metric}", best.metric)
    client.set_tag(parent_run_id, "rayline.best_trial", best.trial_id)
    client.set_tag(parent_run_id, "rayline.best_run_id", best.mlflow_run_id or "")
    return best


def describe_search(cfg: TuneConfig, parent_run_id: str, concurrent: int, arithmetic: str, what: str = "trials") -> None:
    """The search's params and capacity on its MLflow run, and its first line on stdout."""
    params = {**flatten(cfg), "max_concurrent_trials": concurrent}
    log_new_params(parent_run_id, {k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()})
    registry.client().set_tag(parent_run_id, "rayline.capacity", arithmetic)
    print(f"search {cfg.search_name}: {cfg.num_samples} {what}, {concurrent} at a time ({arithmetic})", flush=True)


def run_search(cfg: TuneConfig, trainable, concurrent: int, max_t: int, storage_path: str) -> list:
    """Run the ASHA search over `trainable` (a function trainable, its parameters bound), each trial holding the trial
    driver's CPU, `concurrent` at a time, Tune's state under `storage_path`; Tune's result of every trial."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    fs, path = storage.resolve(storage_path)
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"CPU": TRIAL_DRIVER_CPUS}),
        param_space={k: d.to_tune() for k, d in cfg.space.items()},
        tune_config=tune.TuneConfig(
            metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples,
            scheduler=ASHAScheduler(time_attr="step", max_t=max_t, grace_period=cfg.asha.grace_period,
                                    reduction_factor=cfg.asha.reduction_factor, stop_last_trials=False),
            # The limit goes on the generator itself: Tune ignores max_concurrent_trials when a
            # search_alg generator is passed in.
            search_alg=BasicVariantGenerator(random_state=cfg.seed, max_concurrent=concurrent),
        ),
        run_config=tune.RunConfig(name="tune", storage_path=path, storage_filesystem=fs),
    )
    with ResourceWatch("tune", max_wait_s=cfg.max_wait_s):
        return list(tuner.fit())


def main(cfg: TuneConfig, recipe: TrialRecipe | None = None) -> TuneResult:
    """Run the search (trials of `recipe`, default the train stage's over `cfg.base_train_config()`); register the
    best finished trial. ConfigError (before any trial starts) if it cannot run."""
    import ray
    from ray import tune

    connect_ray()
    meter = usage.StageUsage.start()  # every trial (its Train controller and workers) is this job's
    cluster = ray.cluster_resources()
    concurrent, arithmetic = max_concurrent_trials(cfg, cluster)
    recipe = recipe or TrialRecipe(cfg.base_train_config())
    base = recipe.base
    resources = trial_resources(cfg, cluster)
    plan = recipe.plan(recipe.train_config({}, f"{cfg.search_name}-check", resources_per_worker=resources), cluster)
    # ASHA puts its last rung at max_t; one step short of a trial's end keeps every rung before the final
    # report, so a trial that gets there always finishes (final checkpoint, export, closed MLflow run).
    max_t = min(cfg.asha.max_t or plan.total_steps, plan.total_steps - 1)
    if cfg.asha.grace_period > max_t:
        raise ConfigError(f"asha.grace_period: {cfg.asha.grace_period} steps leaves no rung before the end of a "
                          f"{plan.total_steps}-step trial")

    tags = registry.lineage_tags("tune", **{TAG_TUNE_SEARCH: cfg.search_name,
                                            registry.TAG_DATASET_VERSION: plan.dataset_version,
                                            registry.TAG_DATASET_MANIFEST: plan.manifest_uri,
                                            registry.TAG_BASE_MODEL: plan.base_model_ref, **recipe.lineage_tags()})
    with registry.start_run(cfg.experiment, cfg.search_name, tags=tags) as parent:
        parent_id = parent.info.run_id
        client = registry.client()
        describe_search(cfg, parent_id, concurrent, arithmetic)
        trainable = tune.with_parameters(run_trial, cfg=cfg, recipe=recipe, parent_run_id=parent_id, env=worker_env(),
                                         resources_per_worker=resources)
        grid = run_search(cfg, trainable, concurrent, max_t, storage.join(base.checkpoint.storage_path, cfg.search_name))
        result = TuneResult(cfg.search_name, parent_id, concurrent, arithmetic, lineage=recipe.lineage_tags())
        result.trials = trial_summaries(cfg, grid, parent_id, plan.total_steps)
        result.best = best_trial(cfg, result.trials, parent_id)

        best_cfg = recipe.train_config(result.best.sampled, result.best.run_name,
                                       storage.join(base.checkpoint.storage_path, cfg.search_name), cfg.experiment,
                                       resources)
        best_plan = recipe.plan(best_cfg, cluster)
        version_tags = {registry.TAG_STAGE: recipe.stage, **recipe.lineage_tags(),
                        **recipe.trial_tags(result.best.sampled), TAG_TUNE_SEARCH: cfg.search_name,
                        TAG_TUNE_PARENT: parent_id, TAG_TUNE_TRIAL: result.best.trial_id,
                        TAG_TUNE_METRIC: f"{cfg.metric}={result.best.metric:.6g}"}
        registered = register_export(best_cfg, best_plan, result.best.mlflow_run_id, result.best.step, version_tags,
                                     model_name=cfg.register_as or base.mlflow.register_as,
                                     export_uri=result.best.export_uri)
        if registered:
            result.model_name, result.model_version = registered
            client.set_tag(parent_id, "rayline.model_version", f"{registered[0]}/{registered[1]}")
        result.usage = record_usage("tune", meter, parent_id, registered, plan.manifest_uri)
    return result
