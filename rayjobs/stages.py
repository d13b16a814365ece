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

from core import registry
from rayjobs.leak_checks import looks_secret

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    """`python -m <module>` runs the stage."""
    config_class: str
    """`package.module:Class` of the stage's typed Config."""
    role: str = "trainer"
    """Who its pods act as (rayjobs/roles.py): their ServiceAccount, MLflow login and object-store access."""
    kind: str = "RayJob"
    submit_role: str = ""
    """Who a Jobs API submission of the entry point acts as, when not `role`: `pipelines.serve` deploys the app and
    records the deployment on the version (the rollout's rights), while the RayService's pods only read."""


STAGES = {
    s.name: s
    for s in (
        Stage("data", "pipelines.prepare_data", "data.config:Config"),
        Stage("train", "pipelines.train", "train.config:TrainConfig"),
        Stage("tune", "pipelines.tune", "posttrain.tune_config:PostTrainTuneConfig"),  # a train or a DPO base
        Stage("dpo", "pipelines.dpo", "posttrain.dpo_config:DpoConfig"),
        Stage("grpo", "pipelines.grpo", "posttrain.grpo.config:GrpoConfig"),
        Stage("batch_infer", "pipelines.batch_infer", "serve.batch.config:Config", role="evaluator"),
        Stage("rollout", "pipelines.rollout", "serve.promotion.rollout_config:Config", role="rollout"),
        Stage("serve", "pipelines.serve", "serve.online.serve_config:Config", role="reader", kind="RayService",
              submit_role="rollout"),
    )
}

# What never travels with a job's working_dir (environments, local state, caches).
WORKING_DIR_EXCLUDES = [
    ".venv/", ".git/", ".rayline/", ".rayline-test/", "**/__pycache__/", ".pytest_cache/", "*.egg-info/", "out/",
    ".gl/",
]

# Pointers a laptop's shell passes on to a job submitted from it; never a secret. The Jobs API returns a job's
# runtime_env to every holder of the cluster's token, so credentials come from the cluster's own environment:
# the local stack's Ray processes and, on Kubernetes, each role's Secrets (rayjobs/credentials.py).
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
    "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "RAYLINE_SERVE_URL", "RAYLINE_DASHBOARD_URL",
)
# Not RAYLINE_ROLE: the shell of the stack's own user acts as admin, and a job acts as its stage's role unless
# `--env RAYLINE_ROLE=...` says otherwise.


class SecretInRuntimeEnv(ValueError):
    """A variable named like a secret was about to go into a job's runtime_env."""


def refuse_secrets(env_vars: dict[str, str]) -> None:
    """Raise SecretInRuntimeEnv naming the first variable of `env_vars` that looks like a secret (rayline's manifest
    preflight rule, rayjobs/leak_checks.py); its value is never shown."""
    for name in env_vars:
        if looks_secret(name):
            raise SecretInRuntimeEnv(
                f"{name}: looks like a secret, refused: a job's env is its runtime_env, which the Jobs API shows to "
                "every holder of the cluster's token. Give the cluster the credential instead (its Ray processes' "
                "environment, or the role's Kubernetes Secret)")


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
    """The runtime env of a stage job: the project as working_dir (when given), `env_vars` and the code commit.

    The working_dir travels without `.git`, so a laptop submission records the commit here. Rendered
    manifests leave it out: their code is the image's, which sets RAYLINE_GIT_COMMIT when it is built.
    A variable of `env_vars` named like a secret raises SecretInRuntimeEnv.
    """
    refuse_secrets(env_vars or {})
    env = {"PYTHONUNBUFFERED": "1", **(env_vars or {})}
    if record_commit:
        env["RAYLINE_GIT_COMMIT"] = registry.git_commit()
    renv: dict = {"env_vars": env}
    if working_dir is not None:
        renv["working_dir"] = working_dir
        renv["excludes"] = list(WORKING_DIR_EXCLUDES)
    return renv


def forwarded_env() -> dict[str, str]:
    """The caller's non-secret MLflow/S3/rayline pointers (FORWARDED_ENV), for a job submitted from a laptop."""
    return {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}


def submission_env(stage: Stage, explicit: dict[str, str] | None = None) -> dict[str, str]:
    """The env_vars of a laptop submission of `stage`: its role (as its rendered pods carry it), the caller's
    forwarded pointers, then `explicit` (`--env NAME=VALUE`); a secret among `explicit` raises SecretInRuntimeEnv."""
    refuse_secrets(explicit or {})
    return {"RAYLINE_ROLE": stage.submit_role or stage.role, **forwarded_env(), **(explicit or {})}
