"""Preflight (h): a manifest without rayline's hardening fails validation, naming the manifest's field.

For every pod a RayJob, RayService or RayCluster creates (head, worker groups, a RayJob's submitter, and the
autoscaler container KubeRay injects into an autoscaling head):
- each container restricted with a read-only root filesystem, Ray's with writable /tmp and /tmp/ray
  (rayjobs/pod_security.py);
- no service-account token unless the pod's role calls the Kubernetes API (`rayline.io/role`, rayjobs/roles.py);
- no MLflow login in env, a serving pod (role reader, or any RayService pod without a role) reads no Secret of
  the jobs' read/write object-store credentials, and only the Ray pods of the rollout read the OpenAI endpoint's
  admin key or the MLflow webhook secret (rayjobs/credentials.py).
A ServiceAccount of a role that needs no token must not automount one; rayline's Namespace enforces Pod Security
`restricted`; rayline's Secrets have the shape their pods mount (rayjobs/namespace.py). Inline secret values are
preflight (d), rayjobs/leak_checks.py.

The Secret names come from the cluster profile the manifest was rendered with (default: the built-in profile).
"""

from __future__ import annotations

from rayjobs.cluster_profile import Profile
from rayjobs.credentials import check_credentials
from rayjobs.crd_schema import Problem
from rayjobs.namespace import check_namespace_object
from rayjobs.pod_security import check_pod, check_security_context
from rayjobs.preflight import LAYER, cluster_spec_of
from rayjobs.roles import ROLE_LABEL, ROLES

_JOB_SPEC = {"RayJob": ("spec",), "RayCronJob": ("spec", "jobTemplate")}


def _templates(doc: dict) -> list[tuple[str, dict, bool]]:
    """(path, pod template, whether it is a Ray pod) of every pod the object creates."""
    cluster, base = cluster_spec_of(doc)
    out = []
    if cluster is not None:
        head = (cluster.get("headGroupSpec") or {}).get("template")
        out.append((f"{base}.headGroupSpec.template", head, True))
        for i, g in enumerate(cluster.get("workerGroupSpecs") or []):
            out.append((f"{base}.workerGroupSpecs[{i}].template", (g or {}).get("template"), True))
    job, path = doc, ""
    for key in _JOB_SPEC.get(str(doc.get("kind")), ()):
        job, path = (job or {}).get(key), f"{path}.{key}".lstrip(".")
    if isinstance(job, dict) and isinstance(job.get("submitterPodTemplate"), dict):
        out.append((f"{path}.submitterPodTemplate", job["submitterPodTemplate"], False))
    return [(p, t, ray) for p, t, ray in out if isinstance(t, dict)]


def check_hardening(doc: dict, profile: Profile | None = None) -> list[Problem]:
    """Preflight (h) for one manifest of any kind rayline renders."""
    profile = profile or Profile()
    problems: list[Problem] = []

    def add(path: str, message: str) -> None:
        if (problem := Problem(path, message, LAYER)) not in problems:  # a pod-level gap is met once per container
            problems.append(problem)

    check_namespace_object(doc, profile, add)
    serving_kind = doc.get("kind") == "RayService"
    for path, template, ray in _templates(doc):
        role = ROLES.get(((template.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL))
        kube_api = bool(role and role.kube_api)
        serving = (not role.store_write) if role else serving_kind
        check_pod(template.get("spec"), f"{path}.spec", kube_api, ray, add)
        check_credentials(template.get("spec"), f"{path}.spec", serving, profile, add, role if ray else None)
    cluster, base = cluster_spec_of(doc)
    if cluster is not None and cluster.get("enableInTreeAutoscaling") is True:
        head_spec = ((cluster.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
        check_security_context((cluster.get("autoscalerOptions") or {}).get("securityContext"),
                               head_spec.get("securityContext"), f"{base}.autoscalerOptions.securityContext",
                               f"{base}.headGroupSpec.template.spec.securityContext", add)
    return problems
