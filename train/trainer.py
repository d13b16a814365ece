"""The train stage on the driver: plan, open the MLflow run, run Ray Train's TorchTrainer, register the export.

    from train.config import TrainConfig
    from train.trainer import main
    result = main(cfg)          # or: python -m pipelines.train --config configs/train/tiny.yaml

Storage layout (local or s3://), all under `<checkpoint.storage_path>/<run_name>/`:
    checkpoint_step<NNNNNN>/    DCP shards + trainer_state.json + rng_rank<r>.pt (the latest `num_to_keep`)
    checkpoint_manager_snapshot.json   Ray Train's index of them; a re-submitted run name resumes from it
    export/                     the final Hugging Face checkpoint (safetensors, tokenizer, generation config)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from core import metrics as metrics_api
from core import registry, storage, usage
from core.config import to_dict
from core.ray_cluster import init_ray, ray_address
from core.resource_wait import ResourceWatch
from core.usage import Usage
from train.config import TrainConfig
from train.preflight import RunPlan, plan_run
from train.step_hook import STEP_HOOK_ENV_VARS
from train.tracking import (TAG_EXPORT_URI, TAG_LATEST_CHECKPOINT, MetricLogger, record_usage, register_export,
                            training_run)
from train.worker import train_fn_per_worker

FORWARDED_ENV = (*storage.S3_ENV_VARS, *STEP_HOOK_ENV_VARS, "RAYLINE_GIT_COMMIT", "HF_HOME")


@dataclass
class TrainResult:
    run_name: str
    mlflow_run_id: str
    final_step: int
    total_steps: int
    first_eval_loss: float | None
    eval_loss: float | None
    checkpoint_uri: str
    """The latest sharded checkpoint."""
    export_uri: str
    dataset_version: str
    model_name: str | None = None
    model_version: str | None = None
    goodput: float | None = None
    """This job's productive step time over its wall time, from the driver's start to the end of training: start-up,
    waits, restarts, steps redone after a restart, evals and checkpoints are what it loses (`training_goodput`)."""
    usage: Usage | None = None
    """CPU- and GPU-seconds of this job's processes (core/usage.py)."""


def worker_env() -> dict[str, str]:
    """What workers need from the driver's environment: MLflow, S3 credentials, test-only fault settings."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env["MLFLOW_TRACKING_URI"] = registry.tracking_uri()
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Workers are killed when their function returns; a short report interval keeps their final flush short.
    env.setdefault("RAY_metrics_report_interval_ms", str(metrics_api.REPORT_INTERVAL_MS))
    return env


HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
HEALTH_CHECK_INTERVAL_S = "0.25"
"""How often Ray Train's controller polls its workers. Ray's default (2 s) also paces how fast the controller takes
the workers' reports: one per poll, so a run that reported 4 checkpoints in its last seconds ended ~6 s after its
last step (a 12-step run on the tiny model: fit() returned 5.8 s after the last report, 3.7 s at 0.25 s, of which
~3 s is the workers' final metric flush). A poll is one actor call per worker. A value in the environment wins."""


PREEMPTION_POLL_INTERVAL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
PREEMPTION_POLL_INTERVAL_S = "1"
"""How often Ray Train's preemption watcher reads which nodes are draining. Ray's default (5 s) would eat up to 5 s of
a node's grace (30 s by default: checkpoint.notice_grace_s) before the ranks hear of its termination notice; a poll is
one GCS call for the whole worker group. A value in the environment wins."""


ELASTIC_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ELASTIC_START_TIMEOUT_S = "25"
"""How long Ray Train lets an elastic run's worker group wait to be placed before it asks its scaling policy for a
size again. The policy counts the nodes from a view Ray's autoscaling coordinator refreshes every 20 s, so right after
a node is lost it may still count that node and ask for a size that cannot be placed; with Ray's default (60 s) the
run would stand that long before it tries the size that fits (seen on the stack: 70 s from the loss to the smaller
group, 25 s with this). A value in the environment wins; fixed-size runs keep Ray's default."""


def connect_ray(elastic: bool = False) -> None:
    """Join the cluster and pin, for every process of this job, RAY_ADDRESS (the GCS address), Ray Train's
    controller poll interval (HEALTH_CHECK_INTERVAL_S), its preemption watcher's (PREEMPTION_POLL_INTERVAL_S) and,
    for an elastic run, how long a worker group may wait to be placed (ELASTIC_START_TIMEOUT_S).

    Ray Train's detached placement-group cleaner finds its cluster through the state API, which on a
    machine running several Ray clusters picks the newest one unless RAY_ADDRESS says otherwise; the
    placement group of a trial that ASHA stopped would then never be released and the next trial would
    wait for it forever. Under the Jobs API, RAY_ADDRESS is already the cluster's GCS address.
    """
    gcs = ray_address()
    env = {HEALTH_CHECK_INTERVAL_ENV: os.environ.get(HEALTH_CHECK_INTERVAL_ENV, HEALTH_CHECK_INTERVAL_S),
           PREEMPTION_POLL_INTERVAL_ENV: os.environ.get(PREEMPTION_POLL_INTERVAL_ENV, PREEMPTION_POLL_INTERVAL_S)}
    if elastic:
        env[ELASTIC_START_TIMEOUT_ENV] = os.environ.get(ELASTIC_START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S)
    if gcs:
        env["RAY_ADDRESS"] = gcs
    init_ray(runtime_env={"env_vars": env})


def build_trainer(cfg: TrainConfig, plan: RunPlan, mlflow_run_id: str | None, callbacks: list | None = None,
                  objective=None):
    """The TorchTrainer for one run; `fit()` resumes from `<storage_path>/<run_name>` when it holds checkpoints.
    `objective` (a train.loop.Objective, e.g. posttrain's DPO loss) replaces next-token cross-entropy."""
    import ray.data
    import ray.train
    from data.prepared import read_split
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    fs, path = storage.resolve(cfg.checkpoint.storage_path)
    run_config = ray.train.RunConfig(
        name=cfg.run_name, storage_path=path, storage_filesystem=fs,
        failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
        worker_runtime_env={"env_vars": worker_env()}, callbacks=callbacks or None,
    )
    resources = dict(plan.resources_per_worker)
    scaling = ray.train.ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
                                      resources_per_worker=resources,
                                      label_selector=dict(cfg.scaling.node_labels) or None,
                                      elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s)
    # preserve_order makes the row order and the split deterministic (locality hints off), so equal seeds
    # give equal runs and a resumed run can skip exactly the micro-batches it already trained on. The
    # materialized splits are read here, in the driver, so its context must keep the order too.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    datasets = {split: read_split(plan.manifest_uri, split) for split in ("train", "eval")}
    for split in cfg.data.materialize:
        datasets[split] = datasets[split].materialize()
    # An elastic run's workers each read the whole train split and take their rows of one global order
    # (train/batches.py); eval is split either way.
    data_config = ray.train.DataConfig(datasets_to_split=["eval"] if cfg.scaling.elastic else "all",
                                       execution_options=ExecutionOptions(preserve_order=True))
    return TorchTrainer(
        train_fn_per_worker,
        train_loop_config={"cfg": to_dict(cfg), "plan": plan.to_dict(), "mlflow_run_id": mlflow_run_id,
                           **({"objective": objective} if objective is not None else {})},
        scaling_config=scaling, run_config=run_config, datasets=datasets, dataset_config=data_config,
    )


def result_from_fit(cfg: TrainConfig, plan: RunPlan, run_id: str, fit_result) -> TrainResult:
    metrics = fit_result.metrics or {}
    latest = fit_result.checkpoint
    return TrainResult(
        run_name=cfg.run_name, mlflow_run_id=run_id, final_step=int(metrics.get("step", 0)),
        total_steps=plan.total_steps, first_eval_loss=metrics.get("first_eval_loss"),
        eval_loss=metrics.get("eval_loss"),
        checkpoint_uri=_uri_like(cfg.checkpoint.storage_path, latest.path) if latest else "",
        export_uri=metrics.get("export_uri") or "", dataset_version=plan.dataset_version,
    )


def productive_seconds_before(run_uri: str) -> float:
    """The step time a run had banked in its newest checkpoint before this job (0 for a new run)."""
    from train.checkpoint import newest_trainer_state

    saved = newest_trainer_state(run_uri)
    return saved[1].train_time_s if saved else 0.0


def training_goodput(result: TrainResult, fit_result, before_s: float, started: float, run_id: str) -> None:
    """Set `result.goodput` and log it to the run (`goodput`, `job_wall_time_s`, `productive_step_time_s` at the final
    step): the step time of the steps this job kept (the checkpoints' `train_time_s`, so a step redone after a
    restart counts once) over the job's wall time since `started` (time.monotonic())."""
    wall = time.monotonic() - started
    productive = float((fit_result.metrics or {}).get("train_time_s", before_s)) - before_s
    result.goodput = productive / wall if wall > 0 else None
    logger = MetricLogger(run_id)
    logger.log(result.final_step, {"goodput": result.goodput, "job_wall_time_s": wall,
                                   "productive_step_time_s": productive})
    logger.flush()


def _uri_like(storage_path: str, fs_path: str) -> str:
    """Ray reports paths inside the filesystem; give them back the scheme of the configured storage path."""
    return f"s3://{fs_path}" if storage.is_s3(storage_path) else fs_path


def main(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the training job `cfg.run_name`; raise ConfigError before any worker starts on bad input."""
    import ray

    started = time.monotonic()
    connect_ray(elastic=cfg.scaling.elastic)
    meter = usage.StageUsage.start()
    plan = plan_run(cfg, ray.cluster_resources())
    before_s = productive_seconds_before(plan.run_uri)
    with training_run(cfg, plan) as run_id:
        with ResourceWatch("train", max_wait_s=cfg.scaling.max_wait_s):
            fit_result = build_trainer(cfg, plan, run_id).fit()
        result = result_from_fit(cfg, plan, run_id, fit_result)
        training_goodput(result, fit_result, before_s, started, run_id)
        client = registry.client()
        client.set_tag(run_id, TAG_LATEST_CHECKPOINT, result.checkpoint_uri)
        client.set_tag(run_id, TAG_EXPORT_URI, result.export_uri)
        registered = None
        if result.export_uri and result.final_step >= plan.total_steps:
            registered = register_export(cfg, plan, run_id, result.final_step, export_uri=result.export_uri)
            if registered:
                result.model_name, result.model_version = registered
        result.usage = record_usage("train", meter, run_id, registered, plan.manifest_uri)
    return result
