"""Preflight (d) and (e) of rayjobs/preflight.py: a manifest that leaks a secret or the Ray head's ports.

(d) inline secrets: an env var named like a secret (..._TOKEN, ..._SECRET..., ..._PASSWORD, ..._KEY, ..._KEY_ID)
    with a literal `value` instead of `valueFrom.secretKeyRef`, in any container or runtime_env `env_vars`.
(e) an exposed head: `serviceType` LoadBalancer/NodePort, `enableIngress: true`, or a head/serve Service of those
    types carrying the dashboard (8265), GCS (6379) or client (10001) ports.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from rayjobs.crd_schema import child_path

_EXPOSED_PORTS = {8265: "dashboard", 6379: "GCS", 10001: "Ray client"}
_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIALS", "CREDENTIAL"}
_NOT_SECRET_SUFFIXES = {"PATH", "FILE", "DIR", "URL", "URI", "HOST", "PORT", "ENDPOINT", "NAME", "TYPE", "REGION"}
# rayline's names for where a credential is mounted (rayjobs/credentials.py): a path, never the credential itself.
_POINTERS = {"RAYLINE_MLFLOW_CREDENTIALS"}
Add = Callable[[str, str], None]


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _dig(obj: Any, *keys: str) -> Any:
    for k in keys:
        obj = obj.get(k) if isinstance(obj, dict) else None
    return obj


def looks_secret(name: str) -> bool:
    """Whether an env var called `name` holds a secret: a secret word (TOKEN, SECRET, PASSWORD, KEY, ...) not
    followed by a word that makes it a pointer (..._FILE, ..._URL, ...)."""
    if name.upper() in _POINTERS:
        return False
    words = [w for w in re.split(r"[^A-Z0-9]+", name.upper()) if w]
    return bool(words) and any(w in _SECRET_WORDS for w in words) and words[-1] not in _NOT_SECRET_SUFFIXES


def check_secrets(node: Any, path: str, add: Add) -> None:
    """Container `env` lists and runtime_env `env_vars` maps anywhere under `node`; values are never echoed."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            check_secrets(item, child_path(path, i), add)
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        key_path = child_path(path, str(key))
        if key == "env" and isinstance(value, list):
            for i, e in enumerate(value):
                if isinstance(e, dict) and looks_secret(str(e.get("name", ""))) and e.get("value") and not re.fullmatch(r"\$\(\w+\)", str(e["value"])):
                    add(f"{key_path}[{i}].value", f"{e['name']} looks like a secret but has a literal value; use valueFrom.secretKeyRef")
        elif key == "env_vars" and isinstance(value, dict):
            for name, v in value.items():
                if looks_secret(str(name)) and v and not re.fullmatch(r"\$\{?\w+\}?", str(v)):
                    add(child_path(key_path, str(name)), f"{name} looks like a secret but is written into the runtime_env in plain text; put it in a Secret and expose it through the container env (valueFrom.secretKeyRef)")
        else:
            check_secrets(value, key_path, add)


def check_exposure(doc: dict, cluster: dict, base: str, add: Add) -> None:
    head, head_path = _mapping(cluster.get("headGroupSpec")), f"{base}.headGroupSpec"
    if head.get("serviceType") in ("LoadBalancer", "NodePort"):
        add(f"{head_path}.serviceType", f"{head['serviceType']} exposes the head's dashboard/job API (8265), GCS (6379) and client (10001) ports outside the cluster; use ClusterIP and kubectl port-forward")
    if head.get("enableIngress") is True:
        add(f"{head_path}.enableIngress", "enableIngress publishes the Ray dashboard and job-submission API through an Ingress; keep it off and port-forward")
    services = [(head.get("headService"), f"{head_path}.headService", True)]
    if doc.get("kind") == "RayService":
        services.append(((doc.get("spec") or {}).get("serveService"), "spec.serveService", False))
    for svc, svc_path, defaults_exposed in services:
        if _dig(svc, "spec", "type") in ("LoadBalancer", "NodePort"):
            ports = [p.get("port") for p in _dig(svc, "spec", "ports") or [] if isinstance(p, dict)]
            exposed = [f"{p} ({_EXPOSED_PORTS[p]})" for p in ports if p in _EXPOSED_PORTS]
            if exposed or (defaults_exposed and not ports):
                add(f"{svc_path}.spec.type", f"{_dig(svc, 'spec', 'type')} Service exposes {', '.join(exposed) or 'the default head ports 8265/6379/10001'} outside the cluster")
