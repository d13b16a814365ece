"""The shipped NetworkPolicies, judged by the flows they allow: each flow rayline needs is open, the rest closed.

`allowed` applies the NetworkPolicy semantics of the Kubernetes API (a pod selected by a policy of a type is
isolated for that direction; a flow passes when the source's egress and the destination's ingress both allow it;
policies add up) to pods labelled as the shipped manifests label them, plus the labels KubeRay adds."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress

import pytest
import yaml

from rayjobs import render, stages
from rayjobs.cluster_profile import Peer
from rayjobs.validate import validate_manifest

ROOT = stages.PROJECT_ROOT
NS = "rayline"


def _docs(fname: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "rayjobs" / "rendered" / fname).read_text()))


POLICIES = _docs("namespace/network-policies.yaml") + [d for f in render.SHIPPED for d in _docs(f)
                                                        if d["kind"] == "NetworkPolicy"]


def pod(fname: str, group: str = "head") -> dict:
    """A pod of a shipped manifest as it runs: its template's labels and KubeRay's node-type label."""
    doc = _docs(fname)[0]
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    if group == "submitter":
        return {"ns": NS, "labels": doc["spec"]["submitterPodTemplate"]["metadata"]["labels"]}
    template = cluster["headGroupSpec"]["template"] if group == "head" else cluster["workerGroupSpecs"][0]["template"]
    return {"ns": NS, "labels": {**template["metadata"]["labels"], "ray.io/node-type": group if group == "head" else "worker"}}


def outside(ns: str | None = None, ip: str = "10.1.2.3", **labels: str) -> dict:
    return {"ns": ns, "labels": labels, "ip": ip}


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the shipped policies use matchLabels only
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, who: dict) -> bool:
    if "ipBlock" in peer:
        if who["ns"] is not None:
            return False  # ipBlock is for addresses outside the cluster; what it does to pod IPs is the CNI's choice
        ip, block = ipaddress.ip_address(who["ip"]), peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if who["ns"] is None:
        return False
    ns_ok = (_selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": who["ns"]})
             if "namespaceSelector" in peer else who["ns"] == NS)
    return ns_ok and _selects(peer.get("podSelector", {}), who["labels"])


def _direction_allows(target: dict, other: dict, port: int, protocol: str, kind: str, policies: list[dict]) -> bool:
    if target["ns"] != NS:
        return True  # only rayline's namespace is policed here
    selecting = [p["spec"] for p in policies if kind in p["spec"]["policyTypes"]
                 and _selects(p["spec"]["podSelector"], target["labels"])]
    if not selecting:
        return True
    rules = [r for s in selecting for r in s.get(kind.lower(), [])]
    peers_key = "from" if kind == "Ingress" else "to"
    return any((not r.get(peers_key) or any(_peer_matches(pe, other) for pe in r[peers_key]))
               and (not r.get("ports") or any(pt["port"] == port and pt.get("protocol", "TCP") == protocol
                                              for pt in r["ports"]))
               for r in rules)


def allowed(src: dict, dst: dict, port: int, protocol: str = "TCP", policies: list[dict] | None = None) -> bool:
    """Whether the flow passes under `policies` (default: the shipped ones)."""
    policies = POLICIES if policies is None else policies
    return (_direction_allows(src, dst, port, protocol, "Egress", policies)
            and _direction_allows(dst, src, port, protocol, "Ingress", policies))


DNS = outside("kube-system", **{"k8s-app": "kube-dns"})
S3 = outside(None, ip="52.216.1.1")
MLFLOW = outside("mlflow", app="mlflow")
GATEWAY = outside("ingress-nginx", app="ingress-nginx")
PROMETHEUS = outside("monitoring", **{"app.kubernetes.io/name": "prometheus"})
OPERATOR = outside("kuberay-system", **{"app.kubernetes.io/name": "kuberay-operator"})
API_SERVER = outside(None, ip="10.96.0.1")


def test_the_shipped_policies_validate():
    assert POLICIES and all(validate_manifest(p) == [] for p in POLICIES)


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_a_ray_cluster_talks_within_itself_on_any_port_and_to_no_other(fname):
    head, worker = pod(fname), pod(fname, "worker")
    for port in (6379, 8265, 10001, 20000, 52365):
        assert allowed(worker, head, port) and allowed(head, worker, port)
    if "submitterPodTemplate" in _docs(fname)[0]["spec"]:
        assert allowed(pod(fname, "submitter"), head, 8265)  # `ray job submit` to its own head
    other = "serve-gpu.yaml" if fname != "serve-gpu.yaml" else "train-tiny.yaml"
    assert not allowed(pod(other, "worker"), head, 6379) and not allowed(worker, pod(other), 6379)


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_every_pod_reaches_dns_storage_and_mlflow_and_nothing_else_outside(fname):
    for group in ("head", "worker"):
        p = pod(fname, group)
        assert allowed(p, DNS, 53, "UDP") and allowed(p, DNS, 53, "TCP")
        assert allowed(p, S3, 443) and allowed(p, MLFLOW, 5000)
        assert not allowed(p, S3, 22) and not allowed(p, MLFLOW, 5432) and not allowed(p, outside("default"), 80)
        assert not allowed(p, outside(None, ip="169.254.169.254"), 443)  # the cloud's metadata endpoint
        assert allowed(PROMETHEUS, p, 8080) and not allowed(outside("default"), p, 8080)


def test_only_the_gateway_and_the_rollout_reach_serving_and_only_on_8000():
    serving = pod("serve-gpu.yaml", "worker")
    assert allowed(GATEWAY, serving, 8000) and not allowed(GATEWAY, serving, 8265)
    assert allowed(pod("rollout-tiny.yaml"), serving, 8000)
    assert allowed(pod("rollout-tiny.yaml"), PROMETHEUS, 9090)  # the canary reads its figures there
    assert not allowed(pod("train-tiny.yaml", "worker"), serving, 8000)
    assert not allowed(outside("default"), serving, 8000)


def test_the_operator_reaches_heads_only_on_the_dashboard_and_serve_ports():
    for fname in render.SHIPPED:
        assert allowed(OPERATOR, pod(fname), 8265) and allowed(OPERATOR, pod(fname), 8000)
        assert not allowed(OPERATOR, pod(fname), 6379) and not allowed(OPERATOR, pod(fname, "worker"), 8265)


def test_only_pods_that_call_the_kubernetes_api_reach_it():
    assert allowed(pod("rollout-tiny.yaml"), API_SERVER, 443)
    for fname in render.SHIPPED:
        if fname != "rollout-tiny.yaml":
            assert not allowed(pod(fname), API_SERVER, 443) and not allowed(pod(fname, "worker"), API_SERVER, 6443)
    autoscaling = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), render.load_profile(None),
                                ["autoscaling.min_replicas=1", "autoscaling.max_replicas=3"])
    head_labels = autoscaling["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert allowed({"ns": NS, "labels": head_labels}, API_SERVER, 443)  # its autoscaler patches the RayCluster


def _webhook_rollout(profile) -> tuple[list[dict], dict, dict]:
    """The rollout rendered to take MLflow webhooks on 8765: its policies with the namespace's, its head and worker."""
    docs = render.render_documents("rollout", str(ROOT / "configs/rollout/tiny.yaml"), profile,
                                   ["watch=true", "webhook_port=8765", "webhook_host=0.0.0.0"])
    assert render.validate_rendered(docs, profile) == []
    cluster = docs[0]["spec"]["rayClusterSpec"]
    head, worker = (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"])
    return (_docs("namespace/network-policies.yaml") + [d for d in docs if d["kind"] == "NetworkPolicy"],
            {"ns": NS, "labels": {**head["metadata"]["labels"], "ray.io/node-type": "head"}},
            {"ns": NS, "labels": {**worker["metadata"]["labels"], "ray.io/node-type": "worker"}})


def test_mlflow_reaches_the_rollouts_webhook_port_only_when_its_config_takes_webhooks():
    policies, head, worker = _webhook_rollout(render.load_profile(None))
    assert allowed(MLFLOW, head, 8765, policies=policies)
    assert not allowed(MLFLOW, head, 8766, policies=policies) and not allowed(MLFLOW, head, 8265, policies=policies)
    assert not allowed(MLFLOW, worker, 8765, policies=policies)  # the receiver runs in the driver, on the head
    assert not allowed(outside("default"), head, 8765, policies=policies)
    assert not allowed(GATEWAY, head, 8765, policies=policies) and not allowed(PROMETHEUS, head, 8765, policies=policies)
    shipped = pod("rollout-tiny.yaml")  # configs/rollout/tiny.yaml: webhook_port 0
    assert not any(allowed(MLFLOW, shipped, port) for port in (8765, 8000, 8265))
    assert not allowed(MLFLOW, pod("train-tiny.yaml"), 8765, policies=policies)


def test_the_webhook_rule_takes_mlflow_from_the_profile_as_addresses_too():
    profile = render.load_profile(None)
    by_address = dataclasses.replace(profile, network=dataclasses.replace(
        profile.network, mlflow=Peer(cidrs=["203.0.113.0/24"], ports=[5000])))
    policies, head, _ = _webhook_rollout(by_address)
    assert allowed(outside(None, ip="203.0.113.7"), head, 8765, policies=policies)
    assert not allowed(outside(None, ip="198.51.100.7"), head, 8765, policies=policies)
    assert not allowed(MLFLOW, head, 8765, policies=policies)  # the mlflow namespace's pods no longer count


@pytest.mark.parametrize("edit, path", [
    (lambda s: s.__setitem__("podSelectr", s.pop("podSelector")), "spec.podSelectr"),
    (lambda s: s.__setitem__("ingres", []), "spec.ingres"),
    (lambda s: s["egress"][0]["to"][0]["ipBlock"].__setitem__("cidr", "0.0.0.0/99"), "spec.egress[0].to[0].ipBlock.cidr"),
    (lambda s: s["egress"][0]["ports"][0].__setitem__("protocol", "ICMP"), "spec.egress.0.ports.0.protocol"),
])
def test_a_malformed_network_policy_is_named_at_its_field(edit, path):
    policy = copy.deepcopy(next(p for p in POLICIES if p["metadata"]["name"] == "rayline-allow-object-store"))
    edit(policy["spec"])
    problems = validate_manifest(policy)
    assert path in {p.path for p in problems}, problems
    if path == "spec.podSelectr":
        assert any("did you mean 'podSelector'" in p.message for p in problems)
