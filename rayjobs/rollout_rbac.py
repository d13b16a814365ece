"""What the rollout may do on Kubernetes with `target: kubernetes`: a Role granting get and patch on the
RayServices it updates (by name, nothing else), bound to the rollout's own service account `rayline-rollout`
(rayjobs/roles.py), the only one whose pods mount a token.

    python -m pipelines.render --shipped    # writes rayjobs/rendered/rbac/rollout-rbac.yaml for the shipped RayService

The rollout reads a RayService (`get`) and writes its `spec.serveConfigV2` with a merge patch carrying the
resourceVersion it read (`patch`); serve/promotion/deploy_target.py `KubeRayService`. `check_rbac` validates the objects
offline against the fields of the `rbac.authorization.k8s.io/v1` API that rayline writes (rayjobs/core_schemas.py).
"""

from __future__ import annotations

from rayjobs.core_schemas import RBAC_API, check_core
from rayjobs.crd_schema import Problem
from rayjobs.roles import POD_LABELS

ROLE = "rayline-rollout"
VERBS = ["get", "patch"]  # what KubeRayService calls: get_namespaced_custom_object, patch_namespaced_custom_object


def rollout_rbac(namespace: str, rayservices: list[str], account: str) -> list[dict]:
    """The Role and RoleBinding letting service account `account` get and patch the named RayServices of
    `namespace`."""
    def meta(name: str) -> dict:
        return {"name": name, "namespace": namespace, "labels": {**POD_LABELS, "app.kubernetes.io/component": "rollout"}}

    return [
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": meta(ROLE),
         "rules": [{"apiGroups": ["ray.io"], "resources": ["rayservices"], "resourceNames": sorted(rayservices),
                    "verbs": list(VERBS)}]},
        {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": meta(ROLE),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]


def check_rbac(doc: dict) -> list[Problem]:
    """Schema problems of a Role or RoleBinding, each with its field path; and a Role must grant what the rollout
    calls."""
    if (doc.get("apiVersion"), doc.get("kind")) not in ((RBAC_API, "Role"), (RBAC_API, "RoleBinding")):
        return [Problem("kind", f"{doc.get('apiVersion')} {doc.get('kind')}: expected one of "
                                f"['{RBAC_API} Role', '{RBAC_API} RoleBinding']", "crd-schema")]
    problems = check_core(doc)
    if doc.get("kind") == "Role" and not problems:
        granted = {v for rule in doc.get("rules", []) if "rayservices" in rule.get("resources", [])
                   and "ray.io" in rule.get("apiGroups", []) for v in rule["verbs"]}
        missing = [v for v in VERBS if v not in granted and "*" not in granted]
        if missing:
            problems.append(Problem("rules", f"grants no {missing} on rayservices.ray.io: the rollout calls them",
                                    "preflight"))
    return problems
