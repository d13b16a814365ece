"""The CRD layer on its own: the OpenAPI schema checked by jsonschema with Kubernetes' extensions, the
x-kubernetes-validations rules by cel-python, defaults as the API server applies them."""

from __future__ import annotations

from pathlib import Path

import pytest

import rayjobs
from rayjobs.crd_schema import DEFAULT_CRD_DIR, CelError, check_schema, evaluate_cel, find_version, with_defaults

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def widgets(tmp_path_factory) -> Path:
    """A CRD directory holding the Widget CRD of fixtures/widget-crd.yaml."""
    crd_dir = tmp_path_factory.mktemp("crds")
    (crd_dir / "widgets.yaml").write_text((FIXTURES / "widget-crd.yaml").read_text())
    return crd_dir


def _widget(**spec) -> dict:
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": spec}


def _found(doc: dict, crd_dir: Path | None = None) -> list[tuple[str, str]]:
    return [(p.path, p.message) for p in check_schema(doc, crd_dir)]


def test_the_kuberay_crds_ship_inside_the_package():
    assert DEFAULT_CRD_DIR == Path(rayjobs.__file__).parent / "crds" / "v1.7.0"
    assert (DEFAULT_CRD_DIR / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    for kind in ("RayJob", "RayService", "RayCluster", "RayCronJob"):
        assert find_version("ray.io/v1", kind)["name"] == "v1"


def test_cel_rules_are_evaluated_by_cel_python(widgets):
    assert check_schema(_widget(items=["w-a"], size=1), widgets) == []
    assert _found(_widget(items=["w-a", "w-b"], size=1), widgets) == [("spec", "too many items")]
    assert _found(_widget(items=["w-a", "b"], size=2), widgets) == [("spec", "every item starts with w-")]


def test_a_rule_cel_python_cannot_evaluate_is_reported_not_passed(widgets):
    # isURL() is a Kubernetes CEL library function; `!has(...) ||` decides the rule without it when homepage is unset.
    assert check_schema(_widget(items=[], size=0), widgets) == []
    [(path, message)] = _found(_widget(items=[], size=0, homepage="https://example.com"), widgets)
    assert path == "spec" and "could not be evaluated by cel-python" in message and "isURL" in message


def test_cel_semantics():
    assert evaluate_cel("!(has(self.a) && has(self.b))", {"a": 1}) is True
    assert evaluate_cel("(has(self.a) && has(self.b)) || has(self.c)", {"a": 1}) is False
    assert evaluate_cel("self in ['x', 'y']", "y") is True
    assert evaluate_cel("self.exists(c, c.name == 'ray-head') && size(self) == 2", [{"name": "a"}, {"name": "ray-head"}]) is True
    # CEL's || absorbs an error when its other side is true: reading a missing field is one.
    assert evaluate_cel("self.mode == 'token' || !has(self.mode)", {}) is True
    with pytest.raises(CelError, match="no such member"):
        evaluate_cel("self.mode == 'token'", {})
    with pytest.raises(CelError, match="not a bool"):
        evaluate_cel("size(self)", [1])
    with pytest.raises(CelError, match="does not parse"):
        evaluate_cel("self ==", 1)


def test_cel_rules_of_the_kuberay_crds():
    job = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"},
           "spec": {"entrypoint": "python -m x", "deletionStrategy": {"onSuccess": {"policy": "DeleteCluster"}}}}
    assert _found(job) == [("spec.deletionStrategy", "deletionStrategy requires either BOTH onSuccess and onFailure, "
                                                     "OR the deletionRules field (cannot be empty)")]
    service = {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "s"},
               "spec": {"rayClusterConfig": {"managedBy": "me", "headGroupSpec": {
                   "rayStartParams": {}, "template": {"spec": {"containers": [{"name": "ray-head", "image": "ray"}]}}}}}}
    assert _found(service) == [("spec.rayClusterConfig.managedBy", "the managedBy field value must be either "
                                                                   "'ray.io/kuberay-operator' or 'kueue.x-k8s.io/multikueue'")]
    # `self == oldSelf` (managedBy is immutable) is a transition rule: on a create it does not run.
    service["spec"]["rayClusterConfig"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    assert check_schema(service) == []
    cron = {"apiVersion": "ray.io/v1", "kind": "RayCronJob", "metadata": {"name": "c"}, "spec": {
        "schedule": "0 * * * *", "jobTemplate": {"entrypoint": "python -m x", "deletionStrategy": {
            "deletionRules": [{"condition": {}, "policy": "DeleteCluster"}]}}}}
    assert _found(cron) == [("spec.jobTemplate.deletionStrategy.deletionRules[0].condition",
                             "the deletion condition requires either the JobStatus or the JobDeploymentStatus field.")]


def test_kubernetes_extensions_of_the_schema(widgets):
    ok = dict(items=["w-a"], size=1)
    assert check_schema(_widget(**ok, port=8080, note=None), widgets) == []
    assert check_schema(_widget(**ok, port="http"), widgets) == []
    assert _found(_widget(**ok, port=1.5), widgets) == [("spec.port", "must be an integer or a string, got number 1.5")]
    assert _found(_widget(items=["w-a", "w-a"], size=2), widgets) == [("spec.items[1]", "Duplicate value: 'w-a' (same as [0])")]
    assert _found(_widget(**ok, mode="slow"), widgets) == [("spec.mode", "Unsupported value: 'slow': supported values: 'fast', 'safe'")]
    assert _found(_widget(items=["w-a"], sise=1), widgets)[0] == ("spec.sise", 'unknown field "sise" (did you mean "size"?)')
    assert _found(_widget(items=["w-a"], size=True), widgets) == [("spec.size", "must be of type integer, got boolean True")]
    # A null in a non-nullable field is pruned, then the default fills it.
    assert with_defaults(_widget(**ok, mode=None), widgets)["spec"] == {**ok, "mode": "fast"}


def test_defaults_the_operator_sees():
    job = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"}, "spec": {"entrypoint": "python -m x"}}
    spec = with_defaults(job)["spec"]
    assert spec["submissionMode"] == "K8sJobMode" and spec["backoffLimit"] == 0 and spec["ttlSecondsAfterFinished"] == 0
    assert job["spec"] == {"entrypoint": "python -m x"}, "with_defaults must not change its input"


def test_object_meta():
    job = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j", "labels": {"tier": 1}},
           "spec": {"entrypoint": "python -m x"}}
    assert _found(job) == [("metadata.labels.tier", 'must be of type string, got integer 1 (quote it in YAML: "1")')]
    assert _found({**job, "metadata": {}}) == [("metadata.name", "Required value: name or generateName is required")]
