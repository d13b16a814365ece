"""What each role's pods are given to reach MLflow and the object store, and the preflight that refuses more.

- object store: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY by secretKeyRef, from the read/write Secret for jobs and
  the read-only one for serving pods (a compromised replica cannot overwrite the weights it serves);
- MLflow: the role's own login, Secret `<mlflow_prefix>-<role>` (kubernetes.io/basic-auth), mounted read-only as
  files at MLFLOW_DIR and named by RAYLINE_MLFLOW_CREDENTIALS; never as env values, which `kubectl describe`,
  crash dumps and child processes all see;
- serving pods: the hashed OpenAI API keys (Secret `openai_keys`, key keys.json) as a file, RAYLINE_API_KEYS_FILE;
- the rollout (the one role with `admin_key`): the OpenAI endpoint's admin key (Secret `openai_admin_key`, key
  admin_key) as a file, RAYLINE_ADMIN_KEY_FILE; and, when its rendered config takes MLflow webhooks
  (`webhook_port`), their HMAC secret (Secret `mlflow_webhook`, key secret) as a file, RAYLINE_WEBHOOK_SECRET_FILE.
Every pod says its role in RAYLINE_ROLE. The preflight refuses an MLflow login in env, a serving pod reading the
jobs' write access, and a pod of any other role reading the admin key or the webhook secret.
"""

from __future__ import annotations

from typing import Any, Callable

from rayjobs.cluster_profile import Profile
from rayjobs.roles import ROLES, SERVING, Role

MLFLOW_DIR = "/var/run/secrets/rayline/mlflow"
OPENAI_DIR = "/var/run/secrets/rayline/openai"
ADMIN_KEY_DIR = "/var/run/secrets/rayline/openai-admin"
WEBHOOK_DIR = "/var/run/secrets/rayline/webhook"
API_KEYS, ADMIN_KEY, WEBHOOK_SECRET = "keys.json", "admin_key", "secret"  # the key of each Secret, and the file's name
ADMIN_KEY_FILE, WEBHOOK_SECRET_FILE = f"{ADMIN_KEY_DIR}/{ADMIN_KEY}", f"{WEBHOOK_DIR}/{WEBHOOK_SECRET}"
MLFLOW_VOLUME, OPENAI_VOLUME = "mlflow-credentials", "openai-keys"
ADMIN_KEY_VOLUME, WEBHOOK_VOLUME = "openai-admin-key", "mlflow-webhook-secret"
STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MLFLOW_LOGIN_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_SECRET_FILE_MODE = 0o440  # owner and the pod's fsGroup read; nobody writes
Add = Callable[[str, str], None]


def mlflow_secret(profile: Profile, role: Role) -> str | None:
    prefix = profile.secrets.mlflow_prefix
    return f"{prefix}-{role.name}" if prefix else None


def store_secret(profile: Profile, role: Role) -> str | None:
    return profile.secrets.s3 if role.store_write else profile.secrets.s3_read_only


def _mounted(profile: Profile, role: Role, webhook: bool) -> list[tuple[str, str, str, tuple[str, ...], str, str]]:
    """(volume, Secret, mount path, keys, env var, its value) of each Secret a pod of `role` reads as files."""
    if webhook and not role.webhook:
        raise ValueError(f"role {role.name!r} does not take MLflow webhook deliveries (only the rollout does)")
    s, out = profile.secrets, []
    if secret := mlflow_secret(profile, role):
        out.append((MLFLOW_VOLUME, secret, MLFLOW_DIR, ("username", "password"), "RAYLINE_MLFLOW_CREDENTIALS", MLFLOW_DIR))
    if role == SERVING and s.openai_keys:
        out.append((OPENAI_VOLUME, s.openai_keys, OPENAI_DIR, (API_KEYS,), "RAYLINE_API_KEYS_FILE",
                    f"{OPENAI_DIR}/{API_KEYS}"))
    if role.admin_key and s.openai_admin_key:
        out.append((ADMIN_KEY_VOLUME, s.openai_admin_key, ADMIN_KEY_DIR, (ADMIN_KEY,), "RAYLINE_ADMIN_KEY_FILE",
                    ADMIN_KEY_FILE))
    if webhook and s.mlflow_webhook:
        out.append((WEBHOOK_VOLUME, s.mlflow_webhook, WEBHOOK_DIR, (WEBHOOK_SECRET,), "RAYLINE_WEBHOOK_SECRET_FILE",
                    WEBHOOK_SECRET_FILE))
    return out


def role_env(profile: Profile, role: Role, webhook: bool = False) -> list[dict]:
    """The env of a Ray container of `role`: pointers as values (the mounted Secrets' paths included), secrets by
    secretKeyRef only. `webhook`: the pod takes MLflow webhook deliveries (the rollout with `webhook_port`)."""
    env = [{"name": "MLFLOW_TRACKING_URI", "value": profile.mlflow_tracking_uri},
           {"name": "AWS_REQUEST_CHECKSUM_CALCULATION", "value": "when_required"},
           {"name": "RAYLINE_ROLE", "value": role.name}]
    if profile.s3_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": profile.s3_endpoint})
    env += [{"name": name, "value": value} for *_, name, value in _mounted(profile, role, webhook)]
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


def role_volumes(profile: Profile, role: Role, webhook: bool = False) -> tuple[list[dict], list[dict]]:
    """(volumes, the Ray container's mounts) of a pod of `role`: its MLflow login, for serving the API keys, for the
    rollout the admin key and (with `webhook`) the webhook secret; each read-only."""
    volumes, mounts = [], []
    for volume, secret, path, keys, *_ in _mounted(profile, role, webhook):
        volumes.append(_secret_volume(volume, secret, keys))
        mounts.append({"name": volume, "mountPath": path, "readOnly": True})
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


def check_credentials(spec: Any, path: str, serving: bool, profile: Profile, add: Add,
                      role: Role | None = None) -> None:
    """No MLflow login in any container's env; a serving pod reads no Secret holding the jobs' write access; only a
    Ray pod of a role that needs it (`role`: None for any other pod) reads the admin key or the webhook secret."""
    spec = spec if isinstance(spec, dict) else {}
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            for j, e in enumerate(c.get("env") or [] if isinstance(c, dict) else []):
                if isinstance(e, dict) and e.get("name") in MLFLOW_LOGIN_ENV:
                    add(f"{path}.{field}[{i}].env[{j}]",
                        f"{e['name']} as an env var: MLflow logins are files, the role's Secret "
                        f"{profile.secrets.mlflow_prefix}-<role> mounted at {MLFLOW_DIR} (RAYLINE_MLFLOW_CREDENTIALS)")
    # Secret -> (what it holds, the Role flag of those who may read it)
    guarded = {name: what for name, what in (
        (profile.secrets.openai_admin_key, ("the OpenAI endpoint's admin key (it may force the canary's routing and "
                                            "read rayline's own routes)", "admin_key")),
        (profile.secrets.mlflow_webhook, ("the secret MLflow signs webhook deliveries with", "webhook"))) if name}
    for where, name in _secrets_referenced(spec, path):
        if serving and profile.secrets.s3 and name == profile.secrets.s3:
            add(where, f"a serving pod reads Secret {name!r}, the jobs' read/write object-store credentials; "
                       f"serving pods get the read-only {profile.secrets.s3_read_only!r}")
        if name in guarded and not (role and getattr(role, guarded[name][1])):
            what, flag = guarded[name]
            holders = ", ".join(r.name for r in ROLES.values() if getattr(r, flag))
            who = f"a pod of role {role.name!r}" if role else "a pod that is no role's Ray pod"
            add(where, f"{who} reads Secret {name!r}, {what}: only the Ray pods of role {holders} may mount it")
