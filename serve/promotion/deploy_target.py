"""Where a rendered serve config goes: the local Ray dashboard's Serve REST API, or a KubeRay RayService.

Both take the dict from `serve.online.app.render_serve_config` and replace only this app's entry, leaving
other applications as they are:
  LocalServe      GET/PUT http://<dashboard>/api/serve/applications/ (what `serve deploy` does), with the
                  cluster's auth token when Ray runs with RAY_AUTH_MODE=token;
  KubeRayService  patches `spec.serveConfigV2` of a RayService through the official kubernetes client
                  (CustomObjectsApi.patch_namespaced_custom_object, a JSON merge patch carrying the
                  resourceVersion it was computed from, so a concurrent writer's change is never lost); the
                  KubeRay operator then updates the Serve app on the running cluster in place. It needs get and
                  patch on the RayService (rayjobs/rendered/rbac/rollout-rbac.yaml).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class DeployError(RuntimeError):
    """The target refused or could not take the config; the message says which target and why."""


@dataclass
class AppState:
    """What the target reports about one Serve application."""

    status: str
    """Ray Serve's application status: NOT_STARTED, DEPLOYING, RUNNING, DEPLOY_FAILED, UNHEALTHY, DELETING."""
    message: str = ""
    app_config: dict[str, Any] | None = None
    """The application config the target is driving towards (None: no such app)."""
    deployments: dict[str, dict[str, str]] = field(default_factory=dict)
    """Deployment name -> {status, message}."""
    deployed_at: float | None = None
    """When the target took the app config (Unix seconds), where the target says."""
    replicas: list[dict[str, Any]] = field(default_factory=list)
    """The app's replicas where the target reports them (local Serve): deployment, replica_id, state (STARTING,
    RUNNING, STOPPING, ...), node_id, pid, start_time_s. A RayService's status lists none."""

    def replica_failure(self) -> str | None:
        """The first deployment message saying a replica of the new version failed to start, if any."""
        for name, dep in self.deployments.items():
            msg = dep.get("message", "")
            if dep.get("status") in ("DEPLOY_FAILED", "UNHEALTHY") or "failed to start" in msg:
                return f"{name}: {msg or dep.get('status')}"
        return None


def merge_application(serve_config: dict, current_apps: list[dict], base: dict | None = None) -> dict:
    """A full serve config: `base`'s top-level options, the running apps except ours, then ours."""
    ours = {a["name"] for a in serve_config["applications"]}
    merged = {k: v for k, v in (base or {}).items() if k != "applications"}
    merged.update({k: v for k, v in serve_config.items() if k != "applications"})
    merged["applications"] = [a for a in current_apps if a.get("name") not in ours] + list(serve_config["applications"])
    return merged


def dashboard_url(explicit: str = "") -> str:
    """The Ray dashboard: `explicit`, else RAY_ADDRESS when it is an http URL, else RAYLINE_DASHBOARD_URL
    (the local stack's, forwarded to stage jobs, where Ray sets RAY_ADDRESS to the GCS), else
    http://127.0.0.1:8265 (Ray's default, also a KubeRay head's)."""
    addr = explicit or os.environ.get("RAY_ADDRESS", "")
    if not addr.startswith("http"):
        addr = os.environ.get("RAYLINE_DASHBOARD_URL", "")
    return addr.rstrip("/") if addr.startswith("http") else "http://127.0.0.1:8265"


def ray_auth_token() -> str | None:
    """Ray's auth token (RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH), when the cluster uses token auth."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and Path(path).is_file():
        return Path(path).read_text().strip()
    return None


def _replicas_of(app: dict) -> list[dict[str, Any]]:
    """The replicas in one application's entry of the dashboard's Serve details."""
    return [
        {"deployment": name, **{k: r.get(k) for k in ("replica_id", "state", "node_id", "pid", "start_time_s")}}
        for name, dep in (app.get("deployments") or {}).items() for r in dep.get("replicas") or []
    ]


class LocalServe:
    """A Ray cluster's Serve, through the dashboard's REST API."""

    def __init__(self, app_name: str, url: str = "", token: str | None = None, timeout_s: float = 60.0):
        self.app_name = app_name
        self.url = dashboard_url(url)
        self.token = token if token is not None else ray_auth_token()
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"Ray Serve at {self.url} (app {self.app_name!r})"

    def for_app(self, app_name: str) -> "LocalServe":
        """Another application on the same Serve (a canary's challenger)."""
        return LocalServe(app_name, self.url, self.token, self.timeout_s)

    def _call(self, method: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}/api/serve/applications/", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise DeployError(f"{method} {self.url}/api/serve/applications/: HTTP {e.code}: {e.read().decode()[:2000]}") from None
        except OSError as e:
            raise DeployError(f"{method} {self.url}/api/serve/applications/: {e} (is the Ray dashboard up?)") from None
        return json.loads(text) if text.strip() else {}

    def _details(self) -> dict:
        return self._call("GET")

    def _declarative_apps(self, details: dict) -> list[dict]:
        return [a["deployed_app_config"] for a in details.get("applications", {}).values() if a.get("deployed_app_config")]

    def current(self) -> dict | None:
        """This app's deployed config as the controller holds it, or None."""
        return self.state().app_config

    def state(self) -> AppState:
        app = self._details().get("applications", {}).get(self.app_name)
        if not app:
            return AppState(status="NOT_STARTED")
        deps = {n: {"status": d.get("status", ""), "message": d.get("message", "")}
                for n, d in (app.get("deployments") or {}).items()}
        return AppState(status=app.get("status", ""), message=app.get("message", ""),
                        app_config=app.get("deployed_app_config"), deployments=deps,
                        deployed_at=app.get("last_deployed_time_s"), replicas=_replicas_of(app))

    def replicas(self) -> list[dict[str, Any]]:
        """This app's replicas as the controller reports them: deployment, replica_id, state (STARTING, RUNNING,
        STOPPING, ...), node_id, pid, start_time_s."""
        return _replicas_of(self._details().get("applications", {}).get(self.app_name) or {})

    def apply(self, serve_config: dict) -> None:
        """Deploy `serve_config` (our app only; other declaratively deployed apps are kept)."""
        details = self._details()
        self._call("PUT", merge_application(serve_config, self._declarative_apps(details)))

    def restore(self, app_config: dict | None, http_options: dict | None = None) -> None:
        """Put back a previously captured app config (None: remove the app)."""
        details = self._details()
        if app_config is None and self.app_name not in details.get("applications", {}):
            return  # nothing to remove; and a PUT would start Serve with default (all-interfaces) HTTP options
        others = [a for a in self._declarative_apps(details) if a.get("name") != self.app_name]
        apps = others + ([app_config] if app_config else [])
        # Serve keeps the HTTP options it started with; send those rather than the schema's 0.0.0.0 default.
        options = http_options or details.get("http_options") or {}
        self._call("PUT", {"http_options": options, "applications": apps})

    def delete(self) -> None:
        """Remove this app only (Serve and other apps keep running)."""
        self.restore(None)


class KubeRayService:
    """A RayService's `spec.serveConfigV2`, through the kubernetes client's CustomObjectsApi."""

    def __init__(self, app_name: str, name: str, namespace: str = "default", api: Any = None,
                 group: str = "ray.io", version: str = "v1", plural: str = "rayservices"):
        self.app_name, self.name, self.namespace = app_name, name, namespace
        self.group, self.version, self.plural = group, version, plural
        self._api = api

    @property
    def api(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CustomObjectsApi()
        return self._api

    def describe(self) -> str:
        return f"RayService {self.namespace}/{self.name} (app {self.app_name!r})"

    def for_app(self, app_name: str) -> "KubeRayService":
        """Another application in the same RayService's serveConfigV2 (a canary's challenger)."""
        return KubeRayService(app_name, self.name, self.namespace, self._api, self.group, self.version, self.plural)

    def _api_error(self, verb: str, e: Exception) -> DeployError:
        """The API server's answer as the person running the rollout can act on it (kubernetes' ApiException
        carries `status`, `reason` and a JSON Status body)."""
        status, detail = getattr(e, "status", None), str(e)
        try:
            detail = json.loads(getattr(e, "body", None) or "")["message"]
        except (ValueError, TypeError, KeyError):
            pass
        hint = {403: f" (the service account rayline's pods run as needs get and patch on "
                     f"{self.plural}.{self.group} in namespace {self.namespace}: rayjobs/rendered/rbac/rollout-rbac.yaml)",
                404: " (no such RayService: deploy it first, e.g. rayjobs/rendered/serve-gpu.yaml)"}.get(status, "")
        code = f"HTTP {status} {getattr(e, 'reason', '')}: " if status else ""
        return DeployError(f"{self.describe()}: {verb} refused: {code}{detail}{hint}")

    def _object(self) -> dict:
        try:
            return self.api.get_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, self.name)
        except Exception as e:  # the client raises ApiException; a fake may raise anything
            raise self._api_error("get", e) from None

    def _serve_config(self, obj: dict) -> dict:
        raw = (obj.get("spec") or {}).get("serveConfigV2") or ""
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise DeployError(f"{self.describe()}: spec.serveConfigV2 is not valid YAML: {e}") from None
        data.setdefault("applications", [])
        return data

    CONFLICT_RETRIES = 5

    def _update(self, serve_config_of) -> None:
        """Write `spec.serveConfigV2` = `serve_config_of(the current serveConfigV2)` as a merge patch that carries
        the resourceVersion it was computed from: the API server refuses it (409) if another writer changed the
        RayService in between, and it is computed again from theirs, so their change is never lost."""
        for _ in range(self.CONFLICT_RETRIES):
            obj = self._object()
            version = (obj.get("metadata") or {}).get("resourceVersion")
            body = {"spec": {"serveConfigV2": yaml.safe_dump(serve_config_of(self._serve_config(obj)), sort_keys=False)}}
            if version is not None:
                body["metadata"] = {"resourceVersion": version}
            try:
                self.api.patch_namespaced_custom_object(self.group, self.version, self.namespace, self.plural,
                                                        self.name, body, field_manager="rayline-rollout")
                return
            except Exception as e:
                if getattr(e, "status", None) != 409:
                    raise self._api_error("patch", e) from None
        raise DeployError(f"{self.describe()}: patch refused: the RayService changed under each of "
                          f"{self.CONFLICT_RETRIES} attempts (HTTP 409 Conflict)")

    def current(self) -> dict | None:
        for app in self._serve_config(self._object())["applications"]:
            if app.get("name") == self.app_name:
                return app
        return None

    def state(self) -> AppState:
        obj = self._object()
        status = obj.get("status") or {}
        app_config = next((a for a in self._serve_config(obj)["applications"] if a.get("name") == self.app_name), None)
        # Until the operator has seen our patch its statuses describe the previous config.
        generation = (obj.get("metadata") or {}).get("generation")
        if generation is not None and status.get("observedGeneration") != generation:
            return AppState(status="DEPLOYING", message="operator has not observed the latest spec yet", app_config=app_config)
        if (status.get("pendingServiceStatus") or {}).get("rayClusterName"):
            return AppState(status="DEPLOYING", message="a new Ray cluster is being prepared", app_config=app_config)
        app = ((status.get("activeServiceStatus") or {}).get("applicationStatuses") or {}).get(self.app_name)
        if not app:
            return AppState(status="NOT_STARTED", app_config=app_config)
        deps = {n: {"status": d.get("status", ""), "message": d.get("message", "")}
                for n, d in (app.get("serveDeploymentStatuses") or {}).items()}
        return AppState(status=app.get("status", ""), message=app.get("message", ""), app_config=app_config, deployments=deps)

    def apply(self, serve_config: dict) -> None:
        self._update(lambda current: merge_application(serve_config, current["applications"], base=current))

    def restore(self, app_config: dict | None, http_options: dict | None = None) -> None:
        def restored(current: dict) -> dict:
            apps = [a for a in current["applications"] if a.get("name") != self.app_name]
            return {**current, "applications": apps + ([app_config] if app_config else [])}

        self._update(restored)

    def delete(self) -> None:
        self.restore(None)
