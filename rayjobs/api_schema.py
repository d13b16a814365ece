"""Offline checks of Kubernetes objects that have no CRD in the project (a Prometheus Operator PodMonitor, RBAC
objects): a JSON schema of the fields rayline writes, names and types as the API reference defines them, unknown
fields errors (with the closest known name), each problem with its field path, as `kubectl apply` reports them."""

from __future__ import annotations

import difflib

import jsonschema

from rayjobs.crd_schema import Problem

STRING = {"type": "string"}
LABELS = {"type": "object", "additionalProperties": STRING}
DNS_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}


def metadata(name: dict = DNS_NAME) -> dict:
    """ObjectMeta as rayline writes it."""
    return {"type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": name, "namespace": DNS_NAME, "labels": LABELS, "annotations": LABELS}}


def schema_problems(schema: dict, doc: dict) -> list[Problem]:
    """Every way `doc` breaks `schema`, each with its field path."""
    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties":
            known = list(err.schema.get("properties", {}))
            for field in sorted(set(err.instance) - set(known)):
                close = difflib.get_close_matches(field, known, n=1)
                problems.append(Problem(f"{where}.{field}".lstrip("."), "unknown field" + (
                    f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"), "crd-schema"))
        else:
            problems.append(Problem(where, err.message, "crd-schema"))
    return problems
