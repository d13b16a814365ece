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
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from core import storage

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
TAG_CHECKPOINT_URI = "rayline.checkpoint_uri"  # where it was exported: for people; never what is served
TAG_WEIGHTS_DIGEST = "rayline.weights_digest"  # sha256 digest of the version's files (core/weights_manifest.py)
TAG_WEIGHTS_MANIFEST = "rayline.weights_manifest"  # the manifest's artifact URI on the producing run
# On eval runs: which version they scored (with TAG_WEIGHTS_DIGEST, the bytes).
TAG_MODEL_NAME = "rayline.model_name"
TAG_MODEL_VERSION = "rayline.model_version"
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


CREDENTIALS_ENV = "RAYLINE_MLFLOW_CREDENTIALS"
"""A folder with `username` and `password` (a Kubernetes basic-auth Secret mounted as a volume): this process's login."""
CREDENTIALS_DIR_ENV = "RAYLINE_CREDENTIALS_DIR"
"""A folder of role logins (`<dir>/<role>/{username,password}`, the local stack's `.rayline/credentials`) ..."""
ROLE_ENV = "RAYLINE_ROLE"
"""... and the role this process acts as (trainer, evaluator, promoter, rollout, reader, admin): never a secret, so a
job's runtime_env may carry it; the secrets stay in files on the cluster."""


def login_folder() -> Path | None:
    """The credentials folder this process logs in to MLflow with: $RAYLINE_MLFLOW_CREDENTIALS, else
    $RAYLINE_CREDENTIALS_DIR/$RAYLINE_ROLE; None when neither is set (MLflow's own MLFLOW_TRACKING_* apply)."""
    if os.environ.get(CREDENTIALS_ENV):
        return Path(os.environ[CREDENTIALS_ENV])
    if os.environ.get(CREDENTIALS_DIR_ENV) and os.environ.get(ROLE_ENV):
        return Path(os.environ[CREDENTIALS_DIR_ENV]) / os.environ[ROLE_ENV]
    return None


def use_login() -> str | None:
    """Put this process's login (login_folder) where MLflow's client reads it, per request: MLFLOW_TRACKING_USERNAME
    and MLFLOW_TRACKING_PASSWORD in this process's environment (never a child's command line or a job's runtime_env).
    Returns the username, or None when no rayline login is configured."""
    from core.secret_files import read_login

    folder = login_folder()
    if folder is None:
        return None
    user, password = read_login(folder)
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
    return user


def client() -> MlflowClient:
    import mlflow
    from mlflow.tracking import MlflowClient

    use_login()
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
    """Register an exported Hugging Face checkpoint directory (local path or s3:// URI) as a new version of `name`,
    with the sha256 manifest of its files (core/weights_manifest.py).

    Remote checkpoints are registered in place (source = the URI). MLflow refuses local paths as a version source,
    so a local checkpoint is uploaded into the run's artifacts under `checkpoints/<digest>` (content-addressed:
    never overwritten by another checkpoint of the same run) and the version's source is that artifact. The
    source is the only location ever served; `rayline.checkpoint_uri` keeps the export path for people. The
    manifest is an artifact of the run (`manifests/<digest>.json`) and its digest the tag `rayline.weights_digest`.
    """
    from mlflow.exceptions import MlflowException

    from core import weights_manifest

    c = client()
    manifest = weights_manifest.build(source_uri)
    short = manifest["digest"][:16]
    source = source_uri
    tags = dict(tags or {})
    if run_id:
        with tempfile.TemporaryDirectory(prefix="rayline-manifest-") as tmp:
            path = Path(tmp) / f"{manifest['digest']}.json"
            path.write_text(weights_manifest.to_json(manifest))
            c.log_artifact(run_id, str(path), "manifests")
        artifact_root = c.get_run(run_id).info.artifact_uri.rstrip("/")
        tags[TAG_WEIGHTS_MANIFEST] = f"{artifact_root}/manifests/{manifest['digest']}.json"
    if not storage.is_remote(source_uri):
        if run_id is None:
            raise ValueError(f"{source_uri}: registering a local checkpoint needs the run_id that produced it")
        c.log_artifacts(run_id, storage.resolve(source_uri)[1], f"checkpoints/{short}")
        source = f"{artifact_root}/checkpoints/{short}"
    try:
        c.get_registered_model(name)
    except MlflowException:
        c.create_registered_model(name, description="rayline fine-tuned causal LM (Hugging Face checkpoint)")
    tags[TAG_CHECKPOINT_URI] = source_uri
    tags[TAG_WEIGHTS_DIGEST] = manifest["digest"]
    if run_id:
        tags.setdefault(TAG_SOURCE_RUN, run_id)
    return c.create_model_version(name, source=source, run_id=run_id, tags=tags, description=description)


def registered_manifest(mv: ModelVersion) -> dict | None:
    """The manifest the version was registered with (its run's artifact), or None when it has none."""
    uri = mv.tags.get(TAG_WEIGHTS_MANIFEST)
    if not uri:
        return None
    import mlflow.artifacts

    try:
        return json.loads(mlflow.artifacts.load_text(uri))
    except Exception:  # unreadable or gone: the digest alone still decides, only the per-file names are lost
        return None


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


def set_display_tags(name: str, version: int | str, tags: dict[str, str]) -> str | None:
    """set_version_tags for tags people read and nothing decides on (eval figures, reports): a role that may not
    write `name` (the evaluator on a production model) leaves them off. Returns a note saying so, else None."""
    from mlflow.exceptions import MlflowException

    try:
        set_version_tags(name, version, tags)
    except MlflowException as e:
        if e.error_code != "PERMISSION_DENIED" and "403" not in str(e):
            raise
        note = (f"{name}/{version}: not tagged ({os.environ.get(ROLE_ENV) or 'this login'} may not write {name}); "
                "the run holds the figures")
        print(note, flush=True)
        return note
    return None


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

    Paths and s3:// URIs pass through. A `models:/` reference resolves to its version's `source` and nothing else
    (no tag can redirect it): an s3:// source as it is, a `models:/` source (a version copied from another
    registered model, as the MLflow UI's "Promote model" does) through that version, any other source (MLflow
    artifacts) downloaded into `cache_dir/<name>-v<version>-<digest>`. Whoever loads it checks the bytes
    (serve/online/engine.py `resolve_checkpoint` against the registered manifest).
    """
    if not str(ref).startswith("models:/"):
        return str(ref)
    mv = get_version(ref)
    return source_uri(mv, cache_dir)


def origin_version(mv: ModelVersion) -> ModelVersion:
    """The version whose files `mv` is: itself, or for a copy (source `models:/NAME/N`, as the MLflow UI's "Promote
    model" and `copy_model_version` make) the version it was copied from, followed to the end. Its tags hold the
    registered digest and manifest, and its eval runs are the evidence."""
    seen = 0
    while mv.source.startswith("models:/"):
        seen += 1
        if seen > 4:
            raise LookupError(f"models:/{mv.name}/{mv.version}: its chain of copies ({mv.source}) is too deep")
        mv = get_version(mv.source)
    return mv


def source_uri(mv: ModelVersion, cache_dir: str | Path | None = None) -> str:
    """Where `mv`'s bytes are, as resolve_model_uri describes."""
    mv = origin_version(mv)
    source = mv.source
    if storage.is_s3(source):
        return source
    digest = (mv.tags.get(TAG_WEIGHTS_DIGEST) or "nodigest")[:16]
    target = Path(cache_dir or Path.home() / ".cache" / "rayline" / "models") / f"{mv.name}-v{mv.version}-{digest}"
    if not ((target / "config.json").exists() or (target / "adapter_config.json").exists()):  # a model or an adapter
        import mlflow.artifacts

        staging = target.parent / f".{target.name}.{os.getpid()}"
        mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(staging))
        os.replace(staging / Path(source).name, target)
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
