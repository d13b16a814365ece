"""The local stack's MLflow with authentication (MLflow's own `basic-auth` app) and rayline's roles in it.

MLflow's permission model cannot tell "create a version" from "set an alias" on one registered model (both need
EDIT on it, mlflow/server/auth `validate_can_create_model_version` / `validate_can_set_model_or_prompt_version_alias`).
So what serves and what is trained live in different registered models:

| role       | may                                                                                      |
|------------|------------------------------------------------------------------------------------------|
| admin      | everything (MLflow admin); creates the others, the production models and the experiments   |
| trainer    | its own runs and experiments; versions of candidate models (`<name>-candidates`, any other)  |
| evaluator  | eval runs in `rayline-eval` (the only writer there: the gate's evidence), eval tags on candidates |
| promoter   | production models: copy a candidate in ("Promote model" in the UI), set `champion`/`challenger` |
| rollout    | production models' aliases and tags (roll back, record), runs in `rayline-rollout`          |
| reader     | reads (serving replicas resolving versions and adapters)                                   |

Everyone reads everything (`default_permission = READ`); no request is anonymous. A production model is created by
the admin (here at `stack up`, for the names in the stack config `production_models`), so
no trainer can own one (add your own: `python -m pipelines.stack up production_models=[...]`). Each role's login is a folder with `username` and `password`, 0600
(core/secret_files.py), the shape of a Kubernetes basic-auth Secret mounted as a volume.
"""

from __future__ import annotations

from pathlib import Path

from core.secret_files import ensure_secret, private_dir, read_login, write_login, write_secret

ROLES = ("admin", "trainer", "evaluator", "promoter", "rollout", "reader")
ADMIN = "admin"
EVAL_EXPERIMENT = "rayline-eval"
ROLLOUT_EXPERIMENT = "rayline-rollout"
# The stages' default experiments and the role that writes each. Made by the admin at `up`, so whoever ran a stage
# first (the stack's own user, as admin) does not own one that the stage's role must write.
STAGE_EXPERIMENTS = {"rayline-data": "trainer", "rayline-train": "trainer", "rayline-tune": "trainer",
                     EVAL_EXPERIMENT: "evaluator", ROLLOUT_EXPERIMENT: "rollout"}
CANDIDATES_SUFFIX = "-candidates"


def credentials_dir(state: Path) -> Path:
    return state / "credentials"


def login_dir(state: Path, role: str) -> Path:
    return credentials_dir(state) / role


def ensure_logins(state: Path) -> dict[str, tuple[str, str]]:
    """Every role's login (created with a random password the first time), role -> (username, password)."""
    out = {}
    for role in ROLES:
        folder = login_dir(state, role)
        if not (folder / "password").exists():
            import secrets

            write_login(folder, role, secrets.token_urlsafe(24))
        out[role] = read_login(folder)
    return out


def server_config(state: Path) -> dict[str, str]:
    """The basic-auth app's config file (0600: it holds the admin's first password) and the environment that
    points the MLflow server at it, with its CSRF signing key (MLflow reads that from the environment only; kept in
    a 0600 file between starts); nothing secret goes on its command line."""
    admin_user, admin_password = ensure_logins(state)[ADMIN]
    ini = state / "mlflow" / "basic_auth.ini"
    private_dir(ini.parent)
    write_secret(ini, "\n".join([
        "[mlflow]",
        "default_permission = READ",
        f"database_uri = sqlite:///{state / 'mlflow' / 'auth.db'}",
        f"admin_username = {admin_user}",
        f"admin_password = {admin_password}",
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
        "grant_default_workspace_access = false",
        # Each request's password check is a PBKDF2 hash (~0.1 s on 2 cores): a rollout's few dozen registry calls
        # paid seconds for it. A checked login is trusted for 5 minutes (one worker; the store changes only here).
        "auth_cache_ttl_seconds = 300",
        "",
    ]))
    csrf_key = ensure_secret(credentials_dir(state) / "mlflow_flask_secret_key")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": csrf_key}


def server_argv() -> list[str]:
    """What `mlflow server` adds for authentication."""
    return ["--app-name", "basic-auth"]


def _auth_client(tracking_uri: str, login: tuple[str, str]):
    """MLflow's AuthServiceClient as `login`: it reads the credentials from the environment of this process."""
    import os

    from mlflow.server.auth.client import AuthServiceClient

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = login
    return AuthServiceClient(tracking_uri)


def provision(tracking_uri: str, state: Path, production_models: list[str]) -> None:
    """As the admin: the role users, the stages' experiments (the evaluator alone writes the evidence), and each
    production model with its promoters and the rollout identity as the only writers (a candidate model beside it
    for its trainers). Safe to run again: what exists is kept, grants are set again."""
    import os

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    logins = ensure_logins(state)
    try:
        auth = _auth_client(tracking_uri, logins[ADMIN])
        for role, (user, password) in logins.items():
            if role == ADMIN:
                continue
            try:
                auth.create_user(user, password)
            except MlflowException as e:
                if "already exists" not in str(e).lower():
                    raise
        client = MlflowClient(tracking_uri)

        def grant(user: str, kind: str, name: str, permission: str) -> None:
            try:
                auth.grant_user_permission(logins[user][0], kind, name, permission)
            except MlflowException as e:  # granted by an earlier `up`: set it again, as it is meant to be
                if "already exists" not in str(e).lower():
                    raise
                auth.revoke_user_permission(logins[user][0], kind, name)
                auth.grant_user_permission(logins[user][0], kind, name, permission)

        for experiment, writer in STAGE_EXPERIMENTS.items():
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
            grant(writer, "experiment", exp_id, "EDIT")
        for name in production_models:
            for model, writers in ((name, ("promoter", "rollout")), (name + CANDIDATES_SUFFIX, ("trainer", "evaluator"))):
                try:
                    client.create_registered_model(model, description=(
                        "production: what serves; only promoters copy versions in and set its aliases"
                        if model == name else f"candidates for {name}: trainers register here, promoters copy out"))
                except MlflowException as e:
                    if "already exists" not in str(e).lower():
                        raise
                for writer in writers:
                    grant(writer, "registered_model", model, "EDIT")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
