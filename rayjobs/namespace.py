"""The namespace rayline runs in and who runs there: Pod Security `restricted` enforced (plus audit and warn), one
ServiceAccount per role (rayjobs/roles.py), and the checks that refuse either without its hardening.

    python -m pipelines.render --shipped   # writes rayjobs/rendered/namespace/namespace.yaml, rayjobs/rendered/rbac/service-accounts.yaml

The ServiceAccounts carry no permissions of their own: only `rayline-rollout` is bound to a Role
(rayjobs/rollout_rbac.py), and only its pods mount a token. KubeRay binds the autoscaler's Role to an autoscaling
cluster's head ServiceAccount by itself; there only the autoscaler container gets a token (rayjobs/pod_security.py).
"""

from __future__ import annotations

from typing import Any, Callable

from rayjobs.cluster_profile import Profile
from rayjobs.credentials import ADMIN_KEY, API_KEYS, WEBHOOK_SECRET
from rayjobs.roles import POD_LABELS, ROLE_LABEL, ROLES

PSA_LEVEL = "restricted"
PSA_LABELS = {f"pod-security.kubernetes.io/{mode}": PSA_LEVEL for mode in ("enforce", "audit", "warn")}
Add = Callable[[str, str], None]


def namespace(profile: Profile) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": profile.namespace, "labels": {**POD_LABELS, **PSA_LABELS}}}


def service_accounts(profile: Profile) -> list[dict]:
    return [{"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": role.service_account, "namespace": profile.namespace,
                          "labels": {**POD_LABELS, ROLE_LABEL: role.name}},
             "automountServiceAccountToken": role.kube_api} for role in ROLES.values()]


def check_namespace(doc: dict, add: Add) -> None:
    labels = (doc.get("metadata") or {}).get("labels") or {}
    for key, level in PSA_LABELS.items():
        if labels.get(key) != level:
            add(f"metadata.labels.{key}", f"must be {level!r}: Pod Security admission then refuses any pod in the "
                                          "namespace that is not restricted")


def check_service_account(doc: dict, add: Add) -> None:
    """A ServiceAccount of a role that does not call the Kubernetes API must not hand out tokens."""
    name = (doc.get("metadata") or {}).get("name")
    callers = {r.service_account for r in ROLES.values() if r.kube_api}
    if name not in callers and doc.get("automountServiceAccountToken") is not False:
        add("automountServiceAccountToken", f"must be false: pods running as {name!r} do not call the Kubernetes "
                                            f"API (only {', '.join(sorted(callers))} do)")


def check_secret(doc: dict, profile: Profile, add: Add) -> None:
    """rayline's Secrets have the shape their pods mount: MLflow logins basic-auth, the others the one key each pod
    reads (keys.json, admin_key, secret). Only key names are looked at, never values."""
    name, kind = (doc.get("metadata") or {}).get("name", ""), doc.get("type", "Opaque")
    keys = set(doc.get("data") or {}) | set(doc.get("stringData") or {})
    prefix = profile.secrets.mlflow_prefix
    if prefix and name in {f"{prefix}-{role}" for role in ROLES}:
        if kind != "kubernetes.io/basic-auth":
            add("type", f"{name} is an MLflow login: its type must be kubernetes.io/basic-auth, got {kind!r}")
        if not {"username", "password"} <= keys:
            add("data", f"{name} must hold the keys username and password (has {sorted(keys)})")
    for secret, key, what in ((profile.secrets.openai_keys, API_KEYS, "the hashed API keys"),
                              (profile.secrets.openai_admin_key, ADMIN_KEY, "the admin API key the rollout sends"),
                              (profile.secrets.mlflow_webhook, WEBHOOK_SECRET, "MLflow's webhook signing secret")):
        if secret and name == secret and key not in keys:
            add("data", f"{name} must hold the key {key} ({what}; has {sorted(keys)})")


def check_namespace_object(doc: Any, profile: Profile, add: Add) -> None:
    """The hardening checks of a Namespace, ServiceAccount or Secret (other kinds: nothing)."""
    check = {"Namespace": lambda: check_namespace(doc, add), "ServiceAccount": lambda: check_service_account(doc, add),
             "Secret": lambda: check_secret(doc, profile, add)}.get(doc.get("kind"))
    if check:
        check()
