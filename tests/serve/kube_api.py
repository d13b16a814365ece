"""A stand-in for the Kubernetes API server, for what rayline's RayService target uses of it (issue 20).

No API server can run here, so `KubeRayService` (serve/deploy_target.py) talks to this object in place of
`kubernetes.client.CustomObjectsApi`. It behaves as the API server does for those calls, not permissively:
- `get_namespaced_custom_object` returns a copy; an unknown object is a real `ApiException` 404;
- `patch_namespaced_custom_object` takes a JSON merge patch (RFC 7386: objects merge, `None` deletes, lists and
  scalars replace), bumps `metadata.resourceVersion` on every write and `metadata.generation` when `spec`
  changes, answers 409 Conflict when the patch carries a `metadata.resourceVersion` that is not the current one,
  ignores `status` (a subresource), and validates the result against the KubeRay CRD with the project's own
  validator (rayjobs/crd_schema.py): 422 Unprocessable Entity naming each problem, nothing stored;
- verbs the caller's Role does not grant are 403 Forbidden.
`write_as_another_client` changes the stored object as a concurrent writer (another controller, a person's
`kubectl edit`) does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from rayjobs.crd_schema import check_schema


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _error(status: int, reason: str, message: str) -> ApiException:
    e = ApiException(status=status, reason=reason)
    e.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                         "reason": reason.replace(" ", ""), "code": status})
    return e


class KubeApiStandIn:
    def __init__(self, *objects: dict, plural: str = "rayservices", verbs: tuple[str, ...] = ("get", "patch")):
        self.plural, self.verbs = plural, set(verbs)
        self._version = 1000
        self.store: dict[tuple[str, str], dict] = {}
        self.writes: list[dict] = []  # every accepted patch body, in order
        self.refused: list[int] = []  # the status of every refused call
        for obj in objects:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = self._next_version()
            self.store[(meta.get("namespace", "default"), meta["name"])] = obj

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _check(self, verb: str, group: str, version: str, namespace: str, plural: str, name: str) -> dict:
        if verb not in self.verbs:
            self.refused.append(403)
            raise _error(403, "Forbidden", f'{plural}.{group} "{name}" is forbidden: User '
                         f'"system:serviceaccount:{namespace}:rayline-rollout" cannot {verb} resource "{plural}" '
                         f'in API group "{group}" in the namespace "{namespace}"')
        obj = self.store.get((namespace, name))
        if plural != self.plural or obj is None or obj.get("apiVersion") != f"{group}/{version}":
            self.refused.append(404)
            raise _error(404, "Not Found", f'{plural}.{group} "{name}" not found')
        return obj

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return copy.deepcopy(self._check("get", group, version, namespace, plural, name))

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, field_manager=None,
                                       **_):
        current = self._check("patch", group, version, namespace, plural, name)
        sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent is not None and sent != current["metadata"]["resourceVersion"]:
            self.refused.append(409)
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on {plural}.{group} "{name}": the object '
                         "has been modified; please apply your changes to the latest version and try again")
        patch = {k: v for k, v in body.items() if k != "status"}
        merged = merge_patch(current, patch)
        merged["status"] = copy.deepcopy(current.get("status"))
        problems = check_schema(merged)
        if problems:
            self.refused.append(422)
            raise _error(422, "Unprocessable Entity", f'{current["kind"]}.{group} "{name}" is invalid: ' +
                         "; ".join(f"{p.path}: {p.message}" for p in problems))
        self._store(merged, current)
        self.writes.append(copy.deepcopy(body))
        return copy.deepcopy(merged)

    def _store(self, new: dict, current: dict) -> None:
        meta = new["metadata"]
        if new.get("spec") != current.get("spec"):
            meta["generation"] = current["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_version()
        self.store[(meta.get("namespace", "default"), meta["name"])] = new

    def write_as_another_client(self, namespace: str, name: str, change: Callable[[dict], None]) -> None:
        """Another writer's update: `change` edits a copy of the object, which is stored with a new version."""
        current = self.store[(namespace, name)]
        new = copy.deepcopy(current)
        change(new)
        self._store(new, current)

    def operator_observes(self, namespace: str, name: str, status: dict) -> None:
        """What KubeRay's operator writes to the status subresource once it has acted on the latest spec."""
        obj = self.store[(namespace, name)]
        obj["status"] = {**copy.deepcopy(status), "observedGeneration": obj["metadata"]["generation"]}
        obj["metadata"]["resourceVersion"] = self._next_version()
