"""NetworkPolicies for rayline's namespace: deny all traffic, then allow exactly the flows rayline needs.

    python -m pipelines.render --shipped   # writes rayjobs/rendered/namespace/network-policies.yaml

Namespace-wide (`namespace_policies`): every pod may resolve names (kube-dns, 53 UDP/TCP); rayline's pods may
reach the object store and MLflow; serving pods take Serve traffic (8000) from the gateway and the rollout; the
rollout reaches the serving pods and Prometheus's query API (its canary); Prometheus scrapes the metrics port
(8080); the KubeRay operator reaches each head's dashboard (8265: job and Serve status) and Serve port (8000: the
proxy health it labels the head with); only pods labelled `rayline.io/kube-api` reach the API server. Peers, CIDRs
and ports come from the profile's `network` section.

Per Ray cluster (`cluster_policy`, written after its RayJob or RayService in the same file): the cluster's pods
(and a RayJob's submitter pod) reach each other on every port, since Ray's workers listen on ports chosen at run
time; pods of other clusters do not. A rollout whose head takes MLflow webhook deliveries (its config's
`webhook_port`, the head's port `mlflow-webhook`) also gets `webhook_policy`: the MLflow server (`network.mlflow`)
may reach that port of that head, nothing else of it.
"""

from __future__ import annotations

import ipaddress

from rayjobs.cluster_profile import Peer, Profile
from rayjobs.manifests import DASHBOARD_PORT, METRICS_PORT, SERVE_PORT, WEBHOOK_PORT_NAME
from rayjobs.roles import CLUSTER_LABEL, KUBE_API_LABEL, POD_LABELS, ROLE_LABEL, ROLLOUT, SERVING, Role

API = "networking.k8s.io/v1"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
HEAD = {"ray.io/node-type": "head"}  # KubeRay's label on head pods


def _block(cidr: str, excepted: list[str]) -> dict:
    """An ipBlock: `cidr` less those of `excepted` inside it (the API refuses an `except` outside its `cidr`)."""
    outer = ipaddress.ip_network(cidr)
    inside = [c for c in excepted if ipaddress.ip_network(c).version == outer.version
              and ipaddress.ip_network(c).subnet_of(outer)]
    return {"cidr": cidr, **({"except": inside} if inside else {})}


def peers(peer: Peer) -> list[dict]:
    """NetworkPolicyPeers for a profile peer: its CIDRs, or its pods (in its namespace, or in any)."""
    if peer.cidrs:
        return [{"ipBlock": _block(cidr, peer.except_cidrs)} for cidr in peer.cidrs]
    namespaces = {"matchLabels": {NAMESPACE_LABEL: peer.namespace}} if peer.namespace else {}
    out: dict = {"namespaceSelector": namespaces}
    if peer.pod_labels:
        out["podSelector"] = {"matchLabels": dict(peer.pod_labels)}
    return [out]


def _ports(numbers: list[int], protocols: tuple[str, ...] = ("TCP",)) -> list[dict]:
    return [{"protocol": proto, "port": n} for n in numbers for proto in protocols]


def _selector(labels: dict[str, str]) -> dict:
    return {"matchLabels": dict(labels)} if labels else {}


def _role(role: Role) -> dict:
    return _selector({**POD_LABELS, ROLE_LABEL: role.name})


def _policy(name: str, profile: Profile, pods: dict, ingress: list | None = None, egress: list | None = None,
            deny_all: bool = False) -> dict:
    types = ["Ingress", "Egress"] if deny_all else ["Ingress"] * bool(ingress) + ["Egress"] * bool(egress)
    spec: dict = {"podSelector": pods, "policyTypes": types}
    if ingress:
        spec["ingress"] = ingress
    if egress:
        spec["egress"] = egress
    return {"apiVersion": API, "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": profile.namespace, "labels": dict(POD_LABELS)}, "spec": spec}


def namespace_policies(profile: Profile) -> list[dict]:
    """The namespace's default deny and its allow rules, in the order `kubectl apply` should create them."""
    net, app = profile.network, _selector(POD_LABELS)

    def to(peer: Peer, protocols: tuple[str, ...] = ("TCP",)) -> dict:
        return {"to": peers(peer), "ports": _ports(peer.ports, protocols)}

    return [
        _policy("rayline-default-deny", profile, {}, deny_all=True),
        _policy("rayline-allow-dns", profile, {}, egress=[to(net.dns, ("UDP", "TCP"))]),
        _policy("rayline-allow-object-store", profile, app, egress=[to(net.object_store)]),
        _policy("rayline-allow-mlflow", profile, app, egress=[to(net.mlflow)]),
        _policy("rayline-allow-serve", profile, _role(SERVING), ingress=[
            {"from": peers(net.gateway) + [{"podSelector": _role(ROLLOUT)}], "ports": _ports([SERVE_PORT])}]),
        _policy("rayline-allow-rollout", profile, _role(ROLLOUT), egress=[
            {"to": [{"podSelector": _role(SERVING)}], "ports": _ports([SERVE_PORT])}, to(net.prometheus)]),
        _policy("rayline-allow-metrics", profile, app, ingress=[
            {"from": peers(net.prometheus), "ports": _ports([METRICS_PORT[1]])}]),
        _policy("rayline-allow-kuberay-operator", profile, _selector({**POD_LABELS, **HEAD}), ingress=[
            {"from": peers(net.kuberay_operator), "ports": _ports([DASHBOARD_PORT, SERVE_PORT])}]),
        _policy("rayline-allow-kube-api", profile, _selector({KUBE_API_LABEL: "true"}), egress=[to(net.kube_api)]),
    ]


def cluster_policy(doc: dict, profile: Profile) -> dict:
    """The policy letting the pods of the Ray cluster that the RayJob/RayService `doc` creates reach each other."""
    name = doc["metadata"]["name"]

    def same() -> list[dict]:  # a list of its own each time: shared objects would come out as YAML anchors
        return [{"podSelector": _selector({CLUSTER_LABEL: name})}]

    return _policy(f"{name}-ray-cluster", profile, _selector({CLUSTER_LABEL: name}),
                   ingress=[{"from": same()}], egress=[{"to": same()}])


def webhook_port(doc: dict) -> int | None:
    """The port the head of the RayJob `doc` takes MLflow webhook deliveries on (its port `mlflow-webhook`), if any."""
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return next((p["containerPort"] for p in head.get("ports", []) if p["name"] == WEBHOOK_PORT_NAME), None)


def webhook_policy(doc: dict, profile: Profile) -> dict:
    """The policy letting the MLflow server (`network.mlflow`) deliver webhooks to the head of the rollout RayJob
    `doc`, on the port its head declares for them (the rendered rollout config's `webhook_port`)."""
    name, port = doc["metadata"]["name"], webhook_port(doc)
    if port is None:
        raise ValueError(f"{name}: its head declares no {WEBHOOK_PORT_NAME!r} port (the rollout config's webhook_port)")
    pods = _selector({**POD_LABELS, ROLE_LABEL: ROLLOUT.name, CLUSTER_LABEL: name, **HEAD})
    return _policy(f"{name}-mlflow-webhook", profile, pods,
                   ingress=[{"from": peers(profile.network.mlflow), "ports": _ports([port])}])
