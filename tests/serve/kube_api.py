"""A stand-in for the Kubernetes API server, for what rayline's RayService target uses of it (issue 20).

No API server can run here, so `KubeRayService` (serve/promotion/deploy_target.py) talks to this object in place of
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

`OperatorStandIn` does what KubeRay's operator does for a RayService on a running cluster, against the test's real
Ray: it PUTs each new generation's `serveConfigV2` to the cluster's Serve REST API (as the operator does) and
writes the applications' statuses back, so a rollout with `target: kubernetes` drives real Serve apps.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable

import yaml

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
        self.lock = threading.RLock()  # the API server serializes writes to one object
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
        with self.lock:
            return self._patch(group, version, namespace, plural, name, body)

    def _patch(self, group, version, namespace, plural, name, body):
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
        with self.lock:
            obj = self.store[(namespace, name)]
            obj["status"] = {**copy.deepcopy(status), "observedGeneration": obj["metadata"]["generation"]}
            obj["metadata"]["resourceVersion"] = self._next_version()


class OperatorStandIn:
    """KubeRay's operator for one RayService whose Ray cluster is the test's own (see the module docstring), in a
    thread while the `with` block runs. Apps of the cluster that the RayService never held are left alone."""

    def __init__(self, api: KubeApiStandIn, namespace: str, name: str, serve, every_s: float = 0.3):
        self.api, self.key, self.serve, self.every_s = api, (namespace, name), serve, every_s
        self.owned: set[str] = set()
        self.configs: dict[str, dict] = {}  # app name -> the config last PUT
        self.changed: set[str] = set()  # apps whose config the last PUT changed
        self.applied: tuple[int, float] | None = None  # (generation, when PUT)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._reconcile()
            except Exception as e:  # the test asserts there were none
                self.errors.append(f"{type(e).__name__}: {e}")
            self.stop.wait(self.every_s)

    def _reconcile(self) -> None:
        obj = copy.deepcopy(self.api.store[self.key])
        generation = obj["metadata"]["generation"]
        details = self.serve._details()
        apps = details.get("applications") or {}
        if self.applied is None or self.applied[0] != generation:
            config = yaml.safe_load(obj["spec"]["serveConfigV2"]) or {}
            ours = [a for a in config.get("applications") or []]
            names = {a["name"] for a in ours}
            others = [a["deployed_app_config"] for n, a in apps.items()
                      if a.get("deployed_app_config") and n not in self.owned and n not in names]
            # As KubeRay's operator, the RayService's own http_options (when it has them) go with its apps.
            http = config.get("http_options") or details.get("http_options") or {}
            self.serve._call("PUT", {"http_options": http, "applications": others + ours})
            self.changed = {a["name"] for a in ours if self.configs.get(a["name"]) != a}
            self.owned, self.applied = names, (generation, time.time())
            self.configs = {a["name"]: a for a in ours}
            return
        # Statuses of the latest generation only once Serve has taken it (each changed app deployed since the PUT).
        if any((apps.get(n) or {}).get("last_deployed_time_s", 0) < self.applied[1] - 1 for n in self.changed):
            return
        statuses = {n: {"status": a.get("status", ""), "message": a.get("message", ""),
                        "serveDeploymentStatuses": {d: {"status": v.get("status", ""), "message": v.get("message", "")}
                                                    for d, v in (a.get("deployments") or {}).items()}}
                    for n, a in apps.items() if n in self.owned}
        status = {"activeServiceStatus": {"applicationStatuses": statuses}}
        current = self.api.store[self.key].get("status") or {}
        if current.get("observedGeneration") != generation or current.get("activeServiceStatus") != status["activeServiceStatus"]:
            with self.api.lock:
                if self.api.store[self.key]["metadata"]["generation"] == generation:
                    self.api.operator_observes(*self.key, status)

    def __enter__(self) -> "OperatorStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
