"""A Prometheus Operator PodMonitor for rayline's Ray pods, and its offline check.

Every pod rayline renders (RayJob clusters and the RayService's) carries `app.kubernetes.io/name: rayline`
and a container port named `metrics` (8080), where Ray's metrics agent serves Ray's, Ray Serve's, vLLM's
and rayline's own metrics (rayjobs/manifests.py). One PodMonitor selects them all in the profile's
namespace, and keeps the Ray cluster and node type as labels so dashboards can tell jobs apart.

    python -m pipelines.render --podmonitor [--podmonitor-label release=prometheus] [-o podmonitor.yaml]

The project carries no Prometheus Operator CRD; `check_podmonitor` validates the object against the fields of
the `monitoring.coreos.com/v1` PodMonitor API that rayline writes (names and types as the operator's API
reference defines them; unknown fields are errors), which is what `kubectl apply` would check of them.
"""

from __future__ import annotations

from rayjobs.api_schema import schema_problems
from rayjobs.cluster_profile import Profile
from rayjobs.crd_schema import Problem
from rayjobs.manifests import METRICS_PORT, POD_LABELS, k8s_name

API_VERSION, KIND = "monitoring.coreos.com/v1", "PodMonitor"
_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_RELABEL = {
    "type": "object", "additionalProperties": False,
    "properties": {"sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                   "separator": _STR, "targetLabel": _STR, "regex": _STR, "modulus": {"type": "integer"},
                   "replacement": _STR,
                   "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                                       "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                                       "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                                       "dropequal", "DropEqual"]}},
}
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION}, "kind": {"const": KIND},
        "metadata": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                                    "namespace": _STR, "labels": _LABELS, "annotations": _LABELS}},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": _STR, "podTargetLabels": {"type": "array", "items": _STR},
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array", "items": _STR}}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"port": _STR, "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                                   "path": _STR, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                                   "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                                   "relabelings": {"type": "array", "items": _RELABEL},
                                   "metricRelabelings": {"type": "array", "items": _RELABEL}}}},
            },
        },
    },
}


def podmonitor(profile: Profile, labels: dict[str, str] | None = None, interval: str = "15s") -> dict:
    """One PodMonitor for every rayline Ray pod in the profile's namespace. `labels` go on the PodMonitor itself:
    what your Prometheus's `podMonitorSelector` matches (kube-prometheus-stack: `release: <its release name>`)."""
    keep = [("ray_io_cluster", "ray.io/cluster"), ("ray_io_node_type", "ray.io/node-type")]  # KubeRay's pod labels
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": k8s_name("rayline-ray-nodes"), "namespace": profile.namespace,
                     "labels": {**POD_LABELS, **(labels or {})}},
        "spec": {
            "selector": {"matchLabels": dict(POD_LABELS)},
            "namespaceSelector": {"matchNames": [profile.namespace]},
            "podMetricsEndpoints": [{
                "port": METRICS_PORT[0], "path": "/metrics", "interval": interval,
                "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_" + _label_name(src)],
                                 "targetLabel": target, "action": "replace"} for target, src in keep],
            }],
        },
    }


def _label_name(label: str) -> str:
    """Prometheus's name for a pod label in service discovery (every non-alphanumeric character -> `_`)."""
    return "".join(c if c.isalnum() else "_" for c in label)


def check_podmonitor(doc: dict) -> list[Problem]:
    """Schema problems of a PodMonitor, each with its field path."""
    return schema_problems(SCHEMA, doc)
