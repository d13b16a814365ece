"""The rollout's RBAC (rayjobs/rollout_rbac.py, rayjobs/rendered/rbac/rollout-rbac.yaml): current, valid, least privilege,
and enough: the RayService target works against the API server stand-in with exactly the verbs the Role grants."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config import load_config
from rayjobs import render
from rayjobs.roles import ROLLOUT
from rayjobs.rollout_rbac import check_rbac, rollout_rbac
from serve.online.app import ServedModel, render_serve_config
from serve.promotion.deploy_target import KubeRayService
from serve.online.serve_config import Config
from tests.serve.kube_api import KubeApiStandIn

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_RBAC = ROOT / "rayjobs" / "rendered" / render.ROLLOUT_RBAC


@pytest.fixture(scope="module")
def profile():
    return render.load_profile(None)


def test_the_shipped_rbac_is_current_valid_and_grants_only_get_and_patch_on_the_shipped_rayservice(profile, tmp_path):
    assert render.render_rollout_rbac(tmp_path / "rbac.yaml", profile) == []
    docs = list(yaml.safe_load_all(SHIPPED_RBAC.read_text()))
    assert docs == list(yaml.safe_load_all((tmp_path / "rbac.yaml").read_text())), (
        f"{SHIPPED_RBAC} is stale: run `python -m pipelines.render --shipped`")
    assert [check_rbac(d) for d in docs] == [[], []]
    role, binding = docs
    rayservice = next(yaml.safe_load_all((ROOT / "rayjobs" / "rendered" / "serve-gpu.yaml").read_text()))["metadata"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == rayservice["namespace"]
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayservices"],
                              "resourceNames": [rayservice["name"]], "verbs": ["get", "patch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # Bound to the rollout's own account only: no other role's pods can patch the RayService.
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROLLOUT.service_account,
                                    "namespace": profile.namespace}]


def test_the_granted_verbs_are_what_the_rollout_target_needs():
    role = next(yaml.safe_load_all(SHIPPED_RBAC.read_text()))
    obj = next(yaml.safe_load_all((ROOT / "rayjobs" / "rendered" / "serve-gpu.yaml").read_text()))
    api = KubeApiStandIn(obj, verbs=tuple(role["rules"][0]["verbs"]))
    target = KubeRayService("rayline", obj["metadata"]["name"], obj["metadata"]["namespace"], api=api)
    model = ServedModel(source="s3://m/v2", ref="models:/rayline-small/2", name="rayline-small", version="2")
    target.apply(render_serve_config(load_config(Config, str(ROOT / "configs/serve/gpu_example.yaml")), model))
    assert api.refused == [] and len(api.writes) == 1 and target.current()["args"]["model"]["version"] == "2"


def test_check_names_the_wrong_field_and_a_missing_verb():
    role, binding = rollout_rbac("ml", ["rayline-serve"], "rayline")
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")  # a typo kubectl would refuse
    binding["roleRef"]["kind"] = "Rol"
    assert [(p.path, p.message) for p in check_rbac(role)] == [
        ("rules.0", "'verbs' is a required property"), ("rules.0.verb", "unknown field; did you mean 'verbs'?")]
    assert [p.path for p in check_rbac(binding)] == ["roleRef.kind"]
    role, _ = rollout_rbac("ml", ["rayline-serve"], "rayline")
    role["rules"][0]["verbs"] = ["get"]
    assert [(p.path, p.message) for p in check_rbac(role)] == [
        ("rules", "grants no ['patch'] on rayservices.ray.io: the rollout calls them")]
    assert check_rbac({"apiVersion": "v1", "kind": "Secret"})[0].path == "kind"
