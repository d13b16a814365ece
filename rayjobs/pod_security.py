"""Pod Security `restricted` on every pod rayline renders, and the preflight that refuses a pod without it.

Every container runs as the image's non-root user, without privilege escalation or capabilities, under the
runtime's default seccomp profile, on a read-only root filesystem. Ray writes only where an emptyDir is mounted:
/tmp, /tmp/ray (its session dir: logs, spilled objects, runtime envs) and HOME (model and compiler caches).
No pod mounts a service-account token unless its role calls the Kubernetes API (the rollout); an autoscaling
head's autoscaler container, which patches its RayCluster, gets a projected token the Ray container never sees.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from rayjobs.cluster_profile import Profile

# KubeRay's own name for the /tmp/ray volume: it mounts the volume of that name into the autoscaler sidecar, so
# the head's Ray container and the autoscaler share Ray's logs (and a second, empty /tmp/ray is never created).
RAY_LOGS, RAY_LOGS_DIR = "ray-logs", "/tmp/ray"
TMP, TMP_DIR = "tmp", "/tmp"
HOME = "home"
KUBE_API_TOKEN = "kube-api-token"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where client libraries look for the token
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}
_SECCOMP = ("RuntimeDefault", "Localhost")
Add = Callable[[str, str], None]


def pod_security_context(profile: Profile) -> dict:
    """The pod-level half of `restricted`: who the containers run as, and the seccomp profile."""
    return {"runAsNonRoot": True, "runAsUser": profile.run_as_user, "runAsGroup": profile.run_as_group,
            "fsGroup": profile.run_as_group, "seccompProfile": {"type": "RuntimeDefault"}}


def _writable(profile: Profile) -> tuple[list[dict], list[dict]]:
    dirs = ((TMP, TMP_DIR), (RAY_LOGS, RAY_LOGS_DIR), (HOME, profile.home_dir))
    return ([{"name": name, "emptyDir": {}} for name, _ in dirs],
            [{"name": name, "mountPath": path} for name, path in dirs])


def harden_pod(spec: dict, profile: Profile, kube_api: bool) -> None:
    """Make the pod spec `spec` restricted in place: security contexts, writable emptyDirs, HOME, and a token
    only when `kube_api`."""
    spec["automountServiceAccountToken"] = kube_api
    spec["securityContext"] = pod_security_context(profile)
    volumes, mounts = _writable(profile)
    spec.setdefault("volumes", []).extend(volumes)
    for c in spec["containers"]:
        c["securityContext"] = copy.deepcopy(CONTAINER_SECURITY)
        c.setdefault("volumeMounts", []).extend(copy.deepcopy(mounts))
        c.setdefault("env", []).append({"name": "HOME", "value": profile.home_dir})


def kube_api_token_volume() -> dict:
    """What `automountServiceAccountToken` would mount, as a volume for one container only."""
    return {"name": KUBE_API_TOKEN, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}


def autoscaler_options(profile: Profile) -> dict:
    """`autoscalerOptions` fields for the autoscaler container KubeRay injects into the head: restricted, with
    /tmp and HOME writable (KubeRay mounts /tmp/ray itself) and the head's projected token."""
    return {"securityContext": copy.deepcopy(CONTAINER_SECURITY),
            "env": [{"name": "HOME", "value": profile.home_dir}],
            "volumeMounts": [{"name": TMP, "mountPath": TMP_DIR}, {"name": HOME, "mountPath": profile.home_dir},
                             {"name": KUBE_API_TOKEN, "mountPath": TOKEN_DIR, "readOnly": True}]}


def _effective(key: str, container_sc: dict, pod_sc: dict) -> Any:
    """A container's setting as the kubelet applies it: its own, else the pod's."""
    return container_sc[key] if key in container_sc else pod_sc.get(key)


def check_security_context(sc: Any, pod_sc: Any, path: str, pod_path: str, add: Add) -> None:
    """Pod Security `restricted` (plus a read-only root filesystem) for one container's `securityContext` at `path`,
    given its pod's (at `pod_path`). A setting missing from both is reported where it usually goes: the pod's."""
    sc, pod_sc = sc if isinstance(sc, dict) else {}, pod_sc if isinstance(pod_sc, dict) else {}

    def where(key: str) -> str:
        return f"{path}.{key}" if key in sc else f"{pod_path}.{key}"

    if sc.get("allowPrivilegeEscalation") is not False:
        add(f"{path}.allowPrivilegeEscalation", "must be false (Pod Security restricted)")
    if sc.get("privileged") is True:
        add(f"{path}.privileged", "a privileged container is refused by Pod Security restricted")
    caps = sc.get("capabilities") if isinstance(sc.get("capabilities"), dict) else {}
    if "ALL" not in (caps.get("drop") or []):
        add(f"{path}.capabilities.drop", "must drop ALL capabilities (Pod Security restricted)")
    if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
        add(f"{path}.capabilities.add", "only NET_BIND_SERVICE may be added (Pod Security restricted)")
    if _effective("runAsNonRoot", sc, pod_sc) is not True:
        add(where("runAsNonRoot"), "must be true, in the pod's or the container's securityContext (Pod Security "
                                   "restricted)")
    if _effective("runAsUser", sc, pod_sc) == 0:
        add(where("runAsUser"), "must not be 0 (root)")
    seccomp = _effective("seccompProfile", sc, pod_sc)
    if not (isinstance(seccomp, dict) and seccomp.get("type") in _SECCOMP):
        add(where("seccompProfile"), "must be RuntimeDefault or Localhost, in the pod's or the container's "
                                     "securityContext (Pod Security restricted)")
    if sc.get("readOnlyRootFilesystem") is not True:
        add(f"{path}.readOnlyRootFilesystem", "must be true: code and image stay as built; Ray writes to emptyDirs")


def check_pod(spec: Any, path: str, kube_api: bool, ray: bool, add: Add) -> None:
    """Every container of the pod spec at `path` restricted; Ray's containers (the first of a Ray pod) with
    writable /tmp and /tmp/ray; no service-account token unless `kube_api`."""
    spec = spec if isinstance(spec, dict) else {}
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            if not isinstance(c, dict):
                continue
            check_security_context(c.get("securityContext"), spec.get("securityContext"),
                                   f"{path}.{field}[{i}].securityContext", f"{path}.securityContext", add)
            mounted = {m.get("mountPath") for m in c.get("volumeMounts") or [] if isinstance(m, dict)}
            missing = [d for d in (TMP_DIR, RAY_LOGS_DIR) if d not in mounted]
            if ray and field == "containers" and i == 0 and missing:
                add(f"{path}.{field}[{i}].volumeMounts", f"no writable {', '.join(missing)} on a read-only root "
                                                         "filesystem: ray start cannot write its session dir; mount "
                                                         "an emptyDir there")
    if not kube_api and spec.get("automountServiceAccountToken") is not False:
        add(f"{path}.automountServiceAccountToken", "must be false: this pod does not call the Kubernetes API, so "
                                                    "it must not carry a service-account token (only the rollout does)")
