"""Offline schema checks of the core Kubernetes objects rayline renders or refers to: Namespace, ServiceAccount,
Secret (v1), NetworkPolicy (networking.k8s.io/v1), Role and RoleBinding (rbac.authorization.k8s.io/v1).

The project vendors no JSON schema for core kinds, so these are the fields of each kind's API reference that a
manifest of rayline's may carry, checked by `jsonschema` (rayjobs/api_schema.py): unknown fields are errors with
the closest known name, as `kubectl apply` with strict field validation reports them. `check_core` adds the
value rules the API server applies beyond types (a CIDR that parses; an ipBlock alone in its peer).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from rayjobs.api_schema import DNS_NAME, LABELS, STRING, metadata, schema_problems
from rayjobs.crd_schema import Problem, child_path

RBAC_API, NETWORKING_API = "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"
_STRINGS = {"type": "array", "items": STRING}
_BOOL = {"type": "boolean"}


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": properties}


def _kind(api_version: str, kind: str, required: tuple[str, ...] = (), **fields: dict) -> dict:
    return _strict({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": metadata(), **fields},
                   ("apiVersion", "kind", "metadata", *required))


_SELECTOR = _strict({"matchLabels": LABELS, "matchExpressions": {"type": "array", "items": _strict({
    "key": STRING, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]}, "values": _STRINGS},
    ("key", "operator"))}})
_PEER = _strict({"podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
                 "ipBlock": _strict({"cidr": STRING, "except": _STRINGS}, ("cidr",))})
_PORT = _strict({"protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                 "port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                                    {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 15}]},
                 "endPort": {"type": "integer", "minimum": 1, "maximum": 65535}})
_RULE = {"type": "object", "required": ["verbs"], "additionalProperties": False,
         "properties": {"apiGroups": _STRINGS, "resources": _STRINGS, "resourceNames": _STRINGS,
                        "nonResourceURLs": _STRINGS,
                        "verbs": {"type": "array", "minItems": 1, "items": {
                            "enum": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection",
                                     "*"]}}}}
_LOCAL_REF = _strict({"name": DNS_NAME})

SCHEMAS = {
    ("v1", "Namespace"): _kind("v1", "Namespace", spec=_strict({"finalizers": _STRINGS})),
    ("v1", "ServiceAccount"): _kind("v1", "ServiceAccount", automountServiceAccountToken=_BOOL,
                                    imagePullSecrets={"type": "array", "items": _LOCAL_REF},
                                    secrets={"type": "array", "items": _LOCAL_REF}),
    ("v1", "Secret"): _kind("v1", "Secret", type=STRING, immutable=_BOOL,
                            data={"type": "object", "additionalProperties": {
                                "type": "string", "pattern": r"^[A-Za-z0-9+/]*={0,2}$"}},
                            stringData=LABELS),
    (NETWORKING_API, "NetworkPolicy"): _kind(NETWORKING_API, "NetworkPolicy", ("spec",), spec=_strict({
        "podSelector": _SELECTOR,
        "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}, "uniqueItems": True},
        "ingress": {"type": "array", "items": _strict({"from": {"type": "array", "items": _PEER},
                                                       "ports": {"type": "array", "items": _PORT}})},
        "egress": {"type": "array", "items": _strict({"to": {"type": "array", "items": _PEER},
                                                      "ports": {"type": "array", "items": _PORT}})},
    }, ("podSelector",))),
    (RBAC_API, "Role"): _kind(RBAC_API, "Role", rules={"type": "array", "items": _RULE}),
    (RBAC_API, "RoleBinding"): _kind(RBAC_API, "RoleBinding", ("roleRef",), roleRef=_strict(
        {"apiGroup": {"const": "rbac.authorization.k8s.io"}, "kind": {"enum": ["Role", "ClusterRole"]},
         "name": DNS_NAME}, ("apiGroup", "kind", "name")), subjects={"type": "array", "items": _strict(
        {"kind": {"enum": ["ServiceAccount", "User", "Group"]}, "name": STRING, "namespace": DNS_NAME,
         "apiGroup": STRING}, ("kind", "name"))}),
}


def is_core(doc: Any) -> bool:
    """Whether `doc` is of a kind checked here (and not by a CRD)."""
    return isinstance(doc, dict) and (doc.get("apiVersion"), doc.get("kind")) in SCHEMAS


def _network_policy_values(spec: dict, add) -> None:
    for field, peers_key in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(field) or []):
            for j, peer in enumerate(rule.get(peers_key) or []):
                path = f"spec.{field}[{i}].{peers_key}[{j}]"
                block = peer.get("ipBlock")
                if block and ("podSelector" in peer or "namespaceSelector" in peer):
                    add(path, "ipBlock may not be combined with podSelector or namespaceSelector in one peer")
                for k, cidr in enumerate([block["cidr"], *block.get("except", [])] if block else []):
                    try:
                        ipaddress.ip_network(cidr)
                    except ValueError:
                        add(f"{path}.ipBlock.{'cidr' if k == 0 else f'except[{k - 1}]'}", f"{cidr!r} is not a CIDR")
            for j, port in enumerate(rule.get("ports") or []):
                if "endPort" in port and not isinstance(port.get("port"), int):
                    add(child_path(f"spec.{field}[{i}].ports[{j}]", "endPort"), "endPort needs a numeric port")


def check_core(doc: dict) -> list[Problem]:
    """Schema and value problems of a core object, each with its field path."""
    schema = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        return [Problem("kind", f"{doc.get('apiVersion')} {doc.get('kind')}: expected one of "
                                f"{sorted(f'{a} {k}' for a, k in SCHEMAS)}", "crd-schema")]
    problems = schema_problems(schema, doc)
    if not problems and doc["kind"] == "NetworkPolicy":
        _network_policy_values(doc["spec"], lambda path, msg: problems.append(Problem(path, msg, "crd-schema")))
    return problems
