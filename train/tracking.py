"""MLflow for the train stage: the run's params and lineage tags (driver), step metrics (rank 0), the model version.

The driver opens (or, for a re-submitted run name, reopens) the run and hands its id to the workers;
only rank 0 logs metrics, with MLflow's step = the global optimizer step, so a resumed job continues
the same curves.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from core import registry, usage
from core.config import config_hash, flatten
from train.config import TrainConfig
from train.preflight import RunPlan

TAG_MODEL_VERSION = "rayline.model_version"
TAG_FINAL_STEP = "rayline.final_step"
TAG_LATEST_CHECKPOINT = "rayline.latest_checkpoint"
TAG_EXPORT_URI = "rayline.export_uri"
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value


def run_tags(cfg: TrainConfig, plan: RunPlan, stage: str = "train") -> dict[str, str]:
    """Lineage tags shared by the run and the model version."""
    lora = {registry.TAG_ADAPTER: "lora", registry.TAG_LORA_RANK: str(cfg.lora.rank)} if cfg.lora.enabled else {}
    return registry.lineage_tags(stage, **{
        registry.TAG_DATASET_VERSION: plan.dataset_version,
        registry.TAG_DATASET_MANIFEST: plan.manifest_uri,
        registry.TAG_BASE_MODEL: plan.base_model_ref or cfg.model.path,
        registry.TAG_CONFIG_HASH: config_hash(cfg),
        **lora,
    })


def run_params(cfg: TrainConfig, plan: RunPlan) -> dict[str, str]:
    params = flatten(cfg)
    params.update({
        "plan.total_steps": plan.total_steps, "plan.steps_per_epoch": plan.steps_per_epoch,
        "plan.train_rows": plan.train_rows, "plan.seq_len": plan.seq_len,
        "plan.resources_per_worker": plan.resources_per_worker, "plan.run_uri": plan.run_uri,
    })
    return {k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()}


def log_new_params(run_id: str, params: dict[str, str]) -> list[str]:
    """Log params the run does not have yet; returns the keys whose earlier value differs (MLflow keeps the first)."""
    from mlflow.entities import Param

    client = registry.client()
    existing = client.get_run(run_id).data.params
    new = [Param(k, v) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])
    return sorted(k for k, v in params.items() if k in existing and existing[k] != v)


@contextmanager
def training_run(cfg: TrainConfig, plan: RunPlan, parent_run_id: str | None = None,
                 extra_tags: dict[str, str] | None = None) -> Iterator[str]:
    """Open or continue the MLflow run named `cfg.run_name`; yields its id."""
    tags = {**run_tags(cfg, plan, "tune-trial" if parent_run_id else "train"), **(extra_tags or {})}
    with registry.start_run(cfg.mlflow.experiment, cfg.run_name, tags=tags, resume=True,
                            parent_run_id=parent_run_id) as run:
        changed = log_new_params(run.info.run_id, run_params(cfg, plan))
        if changed:
            print(f"note: resuming MLflow run {run.info.run_id} with changed params {changed[:5]}; "
                  "MLflow keeps their first values (the config hash tag shows the new config)")
        yield run.info.run_id


def register_export(cfg: TrainConfig, plan: RunPlan, run_id: str, final_step: int,
                    extra_tags: dict[str, str] | None = None, model_name: str | None = None,
                    export_uri: str = "") -> tuple[str, str] | None:
    """Register the export at `export_uri` (the directory the run wrote: train/export.py never reuses one) as a
    version of `model_name` (default cfg.mlflow.register_as), once per final step.

    Returns (name, version), or None when registration is off. A re-submitted finished run gets its
    existing version back instead of a duplicate.
    """
    name = model_name or cfg.mlflow.register_as
    if not name:
        return None
    client = registry.client()
    tags = client.get_run(run_id).data.tags
    if tags.get(TAG_FINAL_STEP) == str(final_step) and tags.get(TAG_MODEL_VERSION, "").startswith(f"{name}/"):
        return name, tags[TAG_MODEL_VERSION].split("/", 1)[1]
    version_tags = {**run_tags(cfg, plan), **(extra_tags or {}), TAG_FINAL_STEP: str(final_step)}
    mv = registry.register_checkpoint(name, export_uri or plan.export_uri, run_id=run_id, tags=version_tags,
                                      description=f"{cfg.run_name} step {final_step}")
    client.set_tag(run_id, TAG_MODEL_VERSION, f"{name}/{mv.version}")
    client.set_tag(run_id, TAG_FINAL_STEP, str(final_step))
    return name, str(mv.version)


class MetricLogger:
    """Rank 0's metrics into the driver's run, sent in batches: a step only queues its metrics, and the queue goes out
    in one `log_batch` call once `flush_every_s` has passed since the last one, or at `flush()` (each checkpoint and the
    run's end). A synchronous call per step cost the tiny CPU runs ~15 ms of each 100-160 ms step, with the other rank
    waiting at the next collective. Everything logged up to a checkpoint is sent before the checkpoint is reported,
    so a run that dies after it loses none of the steps it resumes past."""

    MAX_METRICS = 1000
    """MLflow's limit on metrics in one log_batch call."""

    def __init__(self, run_id: str | None, prefix: str = "", flush_every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.run_id = run_id
        self.prefix = prefix
        self.flush_every_s = flush_every_s
        self._client = registry.client() if run_id else None
        self._clock = clock
        self._pending: list = []
        self._sent_at = clock()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(self.prefix + k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if self._clock() - self._sent_at >= self.flush_every_s or len(self._pending) >= self.MAX_METRICS:
            self.flush()

    def flush(self) -> None:
        """Send what is queued (in calls of at most MAX_METRICS)."""
        self._sent_at = self._clock()
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), self.MAX_METRICS):
            batch = pending[i:i + self.MAX_METRICS]
            try:
                self._client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # a tracking hiccup must not kill a training job
                print(f"warning: MLflow log_batch of steps {batch[0].step}-{batch[-1].step} failed: {e}")


def data_usage(manifest_uri: str) -> dict[str, usage.Usage]:
    """{"data": what preparing the dataset version used}, from the data stage's run the manifest names; empty when it
    has none (prepared without MLflow) or that run logged no usage."""
    from data.prepared import load_manifest

    run_id = load_manifest(manifest_uri).get("mlflow_run_id")
    used = usage.of_run(run_id) if run_id else None
    return {"data": used} if used else {}


def record_usage(stage: str, meter: usage.StageUsage, run_id: str | None, registered: tuple[str, str] | None,
                 manifest_uri: str | None, parent: str = "") -> usage.Usage:
    """The job's usage on its run, in Prometheus and, when it registered a version, on that version with what came
    before it: the usage of the data stage that prepared `manifest_uri` (None: the job prepared its data itself, so
    its usage holds it), or, for a post-trained version, what building its `parent` (`models:/NAME/VERSION`) cost."""
    used = meter.totals()
    name, version = registered or ("", "")
    usage.record(stage, used, run_id, model=name, version=version)
    if registered:
        upstream = data_usage(manifest_uri) if manifest_uri else None
        if parent.startswith("models:/"):
            upstream = usage.inherited(registry.get_version(parent).tags)
        usage.tag_version(name, version, stage, used, upstream=upstream)
    return used
