"""The stages rayline packages, and the one entrypoint + runtime env each is run with.

`pipelines.submit` (Jobs API from a laptop) and `pipelines.render` (KubeRay RayJob/RayService) both
take the command line and runtime env from here, so a laptop run and a cluster run cannot drift.
"""

from __future__ import annotations

import importlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipelines import registry

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    """`python -m <module>` runs the stage."""
    config_class: str
    """`package.module:Class` of the stage's typed Config."""
    kind: str = "RayJob"


STAGES = {
    s.name: s
    for s in (
        Stage("data", "pipelines.prepare_data", "data.config:Config"),
        Stage("train", "pipelines.train", "train.config:TrainConfig"),
        Stage("tune", "pipelines.tune", "train.tune_config:TuneConfig"),
        Stage("batch_infer", "pipelines.batch_infer", "serve.batch.config:Config"),
        Stage("rollout", "pipelines.rollout", "serve.rollout_config:Config"),
        Stage("serve", "pipelines.serve", "serve.serve_config:Config", kind="RayService"),
    )
}

# What never travels with a job's working_dir (environments, local state, caches).
WORKING_DIR_EXCLUDES = [
    ".venv/", ".git/", ".rayline/", ".rayline-test/", "**/__pycache__/", ".pytest_cache/", "*.egg-info/", "out/",
    ".gl/",
]

# Variables a laptop's shell passes on to a job submitted from it (never written into manifests:
# on Kubernetes these come from Secrets).
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION",
    "HF_TOKEN", "RAYLINE_SERVE_URL", "RAYLINE_DASHBOARD_URL",
)


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"--stage {name!r}: unknown stage (known: {', '.join(STAGES)})")
    return STAGES[name]


def config_class(stage: Stage) -> type:
    module, cls = stage.config_class.split(":")
    return getattr(importlib.import_module(module), cls)


def relative_config(config_path: str | Path) -> str:
    """The config path as the job sees it: relative to the project root (the job's working_dir)."""
    p = Path(config_path).resolve()
    try:
        return p.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        raise ValueError(
            f"--config {config_path}: must live inside the project ({PROJECT_ROOT}) so it travels with the job"
        ) from None


def entrypoint(stage: Stage, config_path: str | Path, overrides: list[str] | None = None) -> str:
    """`python -m pipelines.<stage> --config configs/... key=value ...`, shell-quoted."""
    argv = ["python", "-m", stage.module, "--config", relative_config(config_path), *(overrides or [])]
    return shlex.join(argv)


def job_runtime_env(working_dir: str | None = ".", env_vars: dict[str, str] | None = None,
                    record_commit: bool = True) -> dict:
    """The runtime env of a stage job: the project as working_dir (when given) and the code commit.

    The working_dir travels without `.git`, so a laptop submission records the commit here. Rendered
    manifests leave it out: their code is the image's, which sets RAYLINE_GIT_COMMIT when it is built.
    """
    env = {"PYTHONUNBUFFERED": "1", **(env_vars or {})}
    if record_commit:
        env["RAYLINE_GIT_COMMIT"] = registry.git_commit()
    renv: dict = {"env_vars": env}
    if working_dir is not None:
        renv["working_dir"] = working_dir
        renv["excludes"] = list(WORKING_DIR_EXCLUDES)
    return renv


def forwarded_env() -> dict[str, str]:
    """The caller's MLflow/S3/HF variables, for a job submitted from a laptop."""
    return {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
