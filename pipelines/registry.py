"""The MLflow calls every stage shares: runs with lineage tags, model versions, aliases, `models:/` resolution.

Tag and alias names used across stages live here as constants, so the data, train, batch and serve
stages agree on them (docs/ARCHITECTURE.md lists them).

mlflow is imported where it is called, not with this module: engine actors, train workers and drivers that
only need the names and paths here would otherwise pay its import (~0.8 s on 2 cores, pandas included)
before they start their real work.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pipelines import storage

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

# Lineage tags (runs and model versions).
TAG_DATASET_VERSION = "rayline.dataset_version"
TAG_DATASET_MANIFEST = "rayline.dataset_manifest"
TAG_BASE_MODEL = "rayline.base_model"
TAG_GIT_COMMIT = "rayline.git_commit"
TAG_CONFIG_HASH = "rayline.config_hash"
TAG_RAY_JOB_ID = "rayline.ray_job_id"
TAG_STAGE = "rayline.stage"
TAG_CHECKPOINT_URI = "rayline.checkpoint_uri"
TAG_SOURCE_RUN = "rayline.source_run_id"
TAG_ADAPTER = "rayline.adapter"  # "lora": the version is an adapter of the version TAG_BASE_MODEL names
TAG_LORA_RANK = "rayline.lora_rank"
DEFAULT_ALIAS = "champion"

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def project_path(path: str | Path) -> Path:
    """A config path as given when it exists from the working directory, else relative to the project."""
    p = Path(path)
    return p if p.is_absolute() or p.is_file() else PROJECT_ROOT / p


def tracking_uri() -> str:
    """The MLflow tracking URI in force (MLFLOW_TRACKING_URI, else the local stack's default)."""
    return os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")


def client() -> MlflowClient:
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri())
    return MlflowClient(tracking_uri())


def git_commit() -> str:
    """The code commit: RAYLINE_GIT_COMMIT (set when the code travels without .git, e.g. a Ray job), else git."""
    if os.environ.get("RAYLINE_GIT_COMMIT"):
        return os.environ["RAYLINE_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if out.returncode != 0 or not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def ray_job_id() -> str | None:
    """The Ray job submission id when running under the Jobs API (RayJob or `ray job submit`).

    Ray's job supervisor passes it to the entrypoint in the job config's metadata
    (RAY_JOB_CONFIG_JSON_ENV_VAR, key `job_submission_id`); RAY_JOB_SUBMISSION_ID, when set, wins.
    """
    if os.environ.get("RAY_JOB_SUBMISSION_ID"):
        return os.environ["RAY_JOB_SUBMISSION_ID"]
    try:
        job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return None
    return (job_config.get("metadata") or {}).get("job_submission_id") or None


def lineage_tags(stage: str, **extra: str | None) -> dict[str, str]:
    """Tags every run carries: stage, git commit, Ray job id, plus whatever lineage the stage passes."""
    tags = {TAG_STAGE: stage, TAG_GIT_COMMIT: git_commit()}
    if ray_job_id():
        tags[TAG_RAY_JOB_ID] = ray_job_id()
    tags.update({k: str(v) for k, v in extra.items() if v is not None})
    return tags


def find_run(experiment: str, run_name: str) -> str | None:
    """The id of the latest run named `run_name` in `experiment`, if any (used to resume a run)."""
    c = client()
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = c.search_runs(
        [exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    return runs[0].info.run_id if runs else None


@contextmanager
def start_run(
    experiment: str, run_name: str, tags: dict[str, str] | None = None, resume: bool = False,
    parent_run_id: str | None = None,
) -> Iterator[mlflow.ActiveRun]:
    """Start (or with `resume`, continue the latest run of the same name) an MLflow run with tags set."""
    import mlflow

    client()
    mlflow.set_experiment(experiment)
    run_id = find_run(experiment, run_name) if resume else None
    kwargs = {"run_id": run_id} if run_id else {"run_name": run_name}
    if parent_run_id:
        kwargs.update(nested=True, parent_run_id=parent_run_id)
    with mlflow.start_run(**kwargs, tags=tags or {}) as run:
        yield run


def register_checkpoint(
    name: str, source_uri: str, run_id: str | None = None, tags: dict[str, str] | None = None,
    description: str | None = None,
) -> ModelVersion:
    """Register an exported Hugging Face checkpoint directory (local path or s3:// URI) as a new version of `name`.

    Remote checkpoints are registered in place (source = the URI). MLflow refuses local paths as a
    version source, so a local checkpoint is uploaded into the run's artifacts (`checkpoint/`) and the
    version's source is that artifact; the local path stays in the `rayline.checkpoint_uri` tag.
    """
    from mlflow.exceptions import MlflowException

    c = client()
    source = source_uri
    if not storage.is_remote(source_uri):
        if run_id is None:
            raise ValueError(f"{source_uri}: registering a local checkpoint needs the run_id that produced it")
        c.log_artifacts(run_id, storage.resolve(source_uri)[1], "checkpoint")
        source = f"{c.get_run(run_id).info.artifact_uri.rstrip('/')}/checkpoint"
    try:
        c.get_registered_model(name)
    except MlflowException:
        c.create_registered_model(name, description="rayline fine-tuned causal LM (Hugging Face checkpoint)")
    tags = dict(tags or {})
    tags[TAG_CHECKPOINT_URI] = source_uri
    if run_id:
        tags.setdefault(TAG_SOURCE_RUN, run_id)
    return c.create_model_version(name, source=source, run_id=run_id, tags=tags, description=description)


def set_alias(name: str, alias: str, version: int | str) -> None:
    client().set_registered_model_alias(name, alias, str(version))


def delete_alias(name: str, alias: str) -> None:
    """Remove `name@alias` (nothing to do when it is not set)."""
    if get_alias(name, alias) is not None:
        client().delete_registered_model_alias(name, alias)


def get_alias(name: str, alias: str = DEFAULT_ALIAS) -> ModelVersion | None:
    """The version behind `name@alias`, or None when the alias is not set."""
    from mlflow.exceptions import MlflowException

    try:
        return client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def set_version_tags(name: str, version: int | str, tags: dict[str, str]) -> None:
    c = client()
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v))


def parse_model_ref(ref: str) -> tuple[str, str | None, str | None]:
    """`models:/name@alias` -> (name, None, alias); `models:/name/3` -> (name, "3", None)."""
    body = ref[len("models:/") :].strip("/")
    if "@" in body:
        name, alias = body.split("@", 1)
        return name, None, alias
    if "/" in body:
        name, version = body.rsplit("/", 1)
        if not version.isdigit():
            raise ValueError(f"{ref}: expected models:/NAME/VERSION (a number) or models:/NAME@ALIAS")
        return name, version, None
    raise ValueError(f"{ref}: expected models:/NAME/VERSION or models:/NAME@ALIAS")


def get_version(ref: str) -> ModelVersion:
    """The ModelVersion behind `models:/name@alias` or `models:/name/N`; a clear error when absent."""
    from mlflow.exceptions import MlflowException

    name, version, alias = parse_model_ref(ref)
    c = client()
    try:
        return c.get_model_version_by_alias(name, alias) if alias else c.get_model_version(name, version)
    except MlflowException as e:
        raise LookupError(f"{ref}: not found in the MLflow registry at {tracking_uri()} ({e.message})") from None


def resolve_model_uri(ref: str, cache_dir: str | Path | None = None) -> str:
    """A model reference -> a URI or local directory holding its Hugging Face checkpoint.

    Paths and s3:// URIs pass through. For `models:/` references: the exported checkpoint when this
    machine can read it (an s3:// URI, or a local path that exists here), else the version's MLflow
    artifacts downloaded into `cache_dir`.
    """
    if not str(ref).startswith("models:/"):
        return str(ref)
    mv = get_version(ref)
    exported = mv.tags.get(TAG_CHECKPOINT_URI) or mv.source
    if storage.is_s3(exported) or (not storage.is_remote(exported) and storage.exists(exported)):
        return exported
    target = Path(cache_dir or Path.home() / ".cache" / "rayline" / "models") / f"{mv.name}-v{mv.version}"
    if not ((target / "config.json").exists() or (target / "adapter_config.json").exists()):  # a model or an adapter
        import mlflow.artifacts

        mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(target.parent / f".{target.name}"))
        os.replace(target.parent / f".{target.name}" / Path(mv.source).name, target)
    return str(target)
