"""What each role's pods are given to reach MLflow and the object store, and the preflight that refuses more.

- object store: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY by secretKeyRef, from the read/write Secret for jobs and
  the read-only one for serving pods (a compromised replica cannot overwrite the weights it serves);
- MLflow: the role's own login, Secret `<mlflow_prefix>-<role>` (kubernetes.io/basic-auth), mounted read-only as
  files at MLFLOW_DIR and named by RAYLINE_MLFLOW_CREDENTIALS; never as env values, which `kubectl describe`,
  crash dumps and child processes all see;
- serving pods: the hashed OpenAI API keys (Secret `openai_keys`, key keys.json) as a file, RAYLINE_API_KEYS_FILE.
Every pod says its role in RAYLINE_ROLE.
"""

from __future__ import annotations

from typing import Any, Callable

from rayjobs.cluster_profile import Profile
from rayjobs.roles import SERVING, Role

MLFLOW_DIR = "/var/run/secrets/rayline/mlflow"
OPENAI_DIR = "/var/run/secrets/rayline/openai"
API_KEYS = "keys.json"
MLFLOW_VOLUME, OPENAI_VOLUME = "mlflow-credentials", "openai-keys"
STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MLFLOW_LOGIN_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_SECRET_FILE_MODE = 0o440  # owner and the pod's fsGroup read; nobody writes
Add = Callable[[str, str], None]


def mlflow_secret(profile: Profile, role: Role) -> str | None:
    prefix = profile.secrets.mlflow_prefix
    return f"{prefix}-{role.name}" if prefix else None


def store_secret(profile: Profile, role: Role) -> str | None:
    return profile.secrets.s3 if role.store_write else profile.secrets.s3_read_only


def role_env(profile: Profile, role: Role) -> list[dict]:
    """The env of a Ray container of `role`: pointers as values, secrets by secretKeyRef only."""
    env = [{"name": "MLFLOW_TRACKING_URI", "value": profile.mlflow_tracking_uri},
           {"name": "AWS_REQUEST_CHECKSUM_CALCULATION", "value": "when_required"},
           {"name": "RAYLINE_ROLE", "value": role.name}]
    if profile.s3_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": profile.s3_endpoint})
    if mlflow_secret(profile, role):
        env.append({"name": "RAYLINE_MLFLOW_CREDENTIALS", "value": MLFLOW_DIR})
    if role == SERVING and profile.secrets.openai_keys:
        env.append({"name": "RAYLINE_API_KEYS_FILE", "value": f"{OPENAI_DIR}/{API_KEYS}"})
    store = store_secret(profile, role)
    refs = [(store, key, False) for key in STORE_KEYS if store]
    refs += [(profile.secrets.hf, "HF_TOKEN", True)] if profile.secrets.hf else []
    for secret, key, optional in refs:
        ref = {"name": secret, "key": key, **({"optional": True} if optional else {})}
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def _secret_volume(name: str, secret: str, keys: tuple[str, ...]) -> dict:
    # Listing the keys makes a Secret without one fail the pod's start, not the first MLflow call.
    return {"name": name, "secret": {"secretName": secret, "defaultMode": _SECRET_FILE_MODE,
                                     "items": [{"key": k, "path": k} for k in keys]}}


def role_volumes(profile: Profile, role: Role) -> tuple[list[dict], list[dict]]:
    """(volumes, the Ray container's mounts) of a pod of `role`: its MLflow login, and for serving the API keys."""
    volumes, mounts = [], []
    if secret := mlflow_secret(profile, role):
        volumes.append(_secret_volume(MLFLOW_VOLUME, secret, ("username", "password")))
        mounts.append({"name": MLFLOW_VOLUME, "mountPath": MLFLOW_DIR, "readOnly": True})
    if role == SERVING and profile.secrets.openai_keys:
        volumes.append(_secret_volume(OPENAI_VOLUME, profile.secrets.openai_keys, (API_KEYS,)))
        mounts.append({"name": OPENAI_VOLUME, "mountPath": OPENAI_DIR, "readOnly": True})
    return volumes, mounts


def _secrets_referenced(spec: dict, path: str) -> list[tuple[str, str]]:
    """(field path, Secret name) of every Secret the pod spec at `path` reads: env, envFrom, volumes."""
    refs = []
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            c_path = f"{path}.{field}[{i}]"
            for j, e in enumerate(c.get("env") or [] if isinstance(c, dict) else []):
                name = ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") if isinstance(e, dict) else None
                refs += [(f"{c_path}.env[{j}].valueFrom.secretKeyRef.name", name)] if name else []
            for j, e in enumerate(c.get("envFrom") or [] if isinstance(c, dict) else []):
                name = (e.get("secretRef") or {}).get("name") if isinstance(e, dict) else None
                refs += [(f"{c_path}.envFrom[{j}].secretRef.name", name)] if name else []
    for i, v in enumerate(spec.get("volumes") or []):
        if not isinstance(v, dict):
            continue
        sources = [v.get("secret") or {}] + [s.get("secret") or {} for s in (v.get("projected") or {}).get("sources") or []]
        refs += [(f"{path}.volumes[{i}]", s.get("secretName") or s.get("name")) for s in sources
                 if s.get("secretName") or s.get("name")]
    return refs


def check_credentials(spec: Any, path: str, serving: bool, profile: Profile, add: Add) -> None:
    """No MLflow login in any container's env; a serving pod reads no Secret holding the jobs' write access."""
    spec = spec if isinstance(spec, dict) else {}
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            for j, e in enumerate(c.get("env") or [] if isinstance(c, dict) else []):
                if isinstance(e, dict) and e.get("name") in MLFLOW_LOGIN_ENV:
                    add(f"{path}.{field}[{i}].env[{j}]",
                        f"{e['name']} as an env var: MLflow logins are files, the role's Secret "
                        f"{profile.secrets.mlflow_prefix}-<role> mounted at {MLFLOW_DIR} (RAYLINE_MLFLOW_CREDENTIALS)")
    if serving and profile.secrets.s3:
        for where, name in _secrets_referenced(spec, path):
            if name == profile.secrets.s3:
                add(where, f"a serving pod reads Secret {name!r}, the jobs' read/write object-store credentials; "
                           f"serving pods get the read-only {profile.secrets.s3_read_only!r}")
