"""What the rollout may do on Kubernetes with `target: kubernetes`: a Role granting get and patch on the
RayServices it updates (by name, nothing else), bound to the service account rayline's pods run as (the cluster
profile's `service_account`, which also carries their storage access).

    python -m pipelines.render --shipped    # writes rayjobs/rbac/rollout-rbac.yaml for the shipped RayService

The rollout reads a RayService (`get`) and writes its `spec.serveConfigV2` with a merge patch carrying the
resourceVersion it read (`patch`); serve/deploy_target.py `KubeRayService`. `check_rbac` validates the objects
offline against the fields of the `rbac.authorization.k8s.io/v1` API that rayline writes (rayjobs/api_schema.py).
"""

from __future__ import annotations

from rayjobs.api_schema import DNS_NAME, STRING, metadata, schema_problems
from rayjobs.crd_schema import Problem
from rayjobs.manifests import POD_LABELS

ROLE = "rayline-rollout"
RBAC_API = "rbac.authorization.k8s.io/v1"
VERBS = ["get", "patch"]  # what KubeRayService calls: get_namespaced_custom_object, patch_namespaced_custom_object

_STRINGS = {"type": "array", "items": STRING}
_RULE = {"type": "object", "required": ["verbs"], "additionalProperties": False,
         "properties": {"apiGroups": _STRINGS, "resources": _STRINGS, "resourceNames": _STRINGS,
                        "nonResourceURLs": _STRINGS,
                        "verbs": {"type": "array", "minItems": 1, "items": {
                            "enum": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection",
                                     "*"]}}}}
SCHEMAS = {
    (RBAC_API, "Role"): {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata"],
        "properties": {"apiVersion": {"const": RBAC_API}, "kind": {"const": "Role"}, "metadata": metadata(),
                       "rules": {"type": "array", "items": _RULE}}},
    (RBAC_API, "RoleBinding"): {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "roleRef"],
        "properties": {
            "apiVersion": {"const": RBAC_API}, "kind": {"const": "RoleBinding"}, "metadata": metadata(),
            "roleRef": {"type": "object", "additionalProperties": False, "required": ["apiGroup", "kind", "name"],
                        "properties": {"apiGroup": {"const": "rbac.authorization.k8s.io"},
                                       "kind": {"enum": ["Role", "ClusterRole"]}, "name": DNS_NAME}},
            "subjects": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["kind", "name"],
                "properties": {"kind": {"enum": ["ServiceAccount", "User", "Group"]}, "name": STRING,
                               "namespace": DNS_NAME, "apiGroup": STRING}}}}},
}


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
    schema = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        return [Problem("kind", f"{doc.get('apiVersion')} {doc.get('kind')}: expected one of "
                                f"{sorted(f'{a} {k}' for a, k in SCHEMAS)}", "crd-schema")]
    problems = schema_problems(schema, doc)
    if doc.get("kind") == "Role" and not problems:
        granted = {v for rule in doc.get("rules", []) if "rayservices" in rule.get("resources", [])
                   and "ray.io" in rule.get("apiGroups", []) for v in rule["verbs"]}
        missing = [v for v in VERBS if v not in granted and "*" not in granted]
        if missing:
            problems.append(Problem("rules", f"grants no {missing} on rayservices.ray.io: the rollout calls them",
                                    "preflight"))
    return problems
