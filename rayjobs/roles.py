"""Who a rendered pod acts as: its role, the ServiceAccount it runs under, whether it may call the Kubernetes API,
and whether its object-store credentials may write.

A role is also what a job or a pod says it is (`RAYLINE_ROLE`) and which MLflow login it gets: the Secret
`<profile.secrets.mlflow_prefix>-<role>` (rayjobs/credentials.py). Stages map to roles in rayjobs/stages.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# What every rayline pod carries (the PodMonitor and the NetworkPolicies select on them).
POD_LABELS = {"app.kubernetes.io/name": "rayline"}
ROLE_LABEL = "rayline.io/role"
CLUSTER_LABEL = "rayline.io/cluster"
"""The rendered manifest's name: KubeRay's own `ray.io/cluster` label carries a suffix generated at run time."""
KUBE_API_LABEL = "rayline.io/kube-api"
"""On pods with a container that calls the Kubernetes API: only they may reach it."""


@dataclass(frozen=True)
class Role:
    name: str
    """`RAYLINE_ROLE`, and the suffix of the role's MLflow Secret."""
    service_account: str
    kube_api: bool = False
    """Its pods call the Kubernetes API and so mount a service-account token; every other pod goes without one."""
    store_write: bool = True
    """Jobs write datasets and checkpoints; serving pods only read the model they serve."""
    admin_key: bool = False
    """Its pods send rayline's own requests to the OpenAI endpoint (smoke requests, the canary's probes and stats) and
    so mount the endpoint's admin key; no other pod may read it."""
    webhook: bool = False
    """Its pods may take MLflow webhook deliveries (the rollout's `--watch` with `webhook_port`) and so may mount the
    secret MLflow signs them with."""


ROLES = {r.name: r for r in (
    Role("trainer", "rayline-trainer"),
    Role("evaluator", "rayline-evaluator"),
    # The only role bound to the Role that may patch the RayService (rayjobs/rollout_rbac.py), and the only one
    # that talks to the app as its admin: the serving pods answer requests and send none (`pipelines.serve`'s smoke
    # requests come from wherever it runs; on Kubernetes the RayService is deployed by KubeRay, not by it).
    Role("rollout", "rayline-rollout", kube_api=True, admin_key=True, webhook=True),
    Role("reader", "rayline-serving", store_write=False),
)}
SERVING = ROLES["reader"]
ROLLOUT = ROLES["rollout"]


def get_role(name: str) -> Role:
    if name not in ROLES:
        raise ValueError(f"role {name!r}: unknown (known: {', '.join(ROLES)})")
    return ROLES[name]
