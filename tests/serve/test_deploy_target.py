"""Deploy targets: LocalServe against the test stack's real Ray dashboard (Serve REST API) with a tiny Serve app;
KubeRayService's patch body and status parsing against a recording CustomObjectsApi (no Kubernetes API server
runs in the test run); app merging and dashboard URL rules.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import yaml

from core.config import load_config
from serve.online.app import ServedModel, render_serve_config
from serve.promotion.deploy_target import AppState, DeployError, KubeRayService, LocalServe, dashboard_url, merge_application
from serve.online.serve_config import Config

MODEL = ServedModel(source="s3://models/rayline-small/v7", ref="models:/rayline-small/7", name="rayline-small", version="7")


class FakeCustomObjects:
    """Records calls the way kubernetes.client.CustomObjectsApi receives them."""

    def __init__(self, obj: dict):
        self.obj = obj
        self.patches: list[tuple] = []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        assert (group, version, plural) == ("ray.io", "v1", "rayservices")
        if name != self.obj["metadata"]["name"]:
            raise RuntimeError(f"(404) rayservices {name} not found")
        return self.obj

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kwargs):
        self.patches.append(((group, version, namespace, plural, name), body, kwargs))
        self.obj["spec"]["serveConfigV2"] = body["spec"]["serveConfigV2"]


def rayservice(serve_config: dict, status: dict | None = None, generation: int = 3) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": {"name": "rayline-serve", "namespace": "ml", "generation": generation},
            "spec": {"serveConfigV2": yaml.safe_dump(serve_config), "rayClusterConfig": {"headGroupSpec": {}}},
            "status": status or {}}


@pytest.fixture()
def gpu_cfg() -> Config:
    return load_config(Config, "configs/serve/gpu_example.yaml")


def test_patch_replaces_only_our_app_in_serve_config_v2(gpu_cfg):
    other = {"name": "embeddings", "route_prefix": "/embed", "import_path": "emb.app:build"}
    old_app = {"name": "rayline", "route_prefix": "/", "import_path": "serve.online.app:build_app", "args": {"model": None}}
    api = FakeCustomObjects(rayservice({"http_options": {"host": "0.0.0.0", "port": 8000},
                                        "applications": [other, old_app]}))
    target = KubeRayService("rayline", "rayline-serve", "ml", api=api)

    target.apply(render_serve_config(gpu_cfg, MODEL))

    ((where, body, kwargs),) = api.patches
    assert where == ("ray.io", "v1", "ml", "rayservices", "rayline-serve")
    assert kwargs == {"field_manager": "rayline-rollout"}
    assert set(body) == {"spec"} and set(body["spec"]) == {"serveConfigV2"}  # a merge patch of that one field
    new = yaml.safe_load(body["spec"]["serveConfigV2"])
    assert [a["name"] for a in new["applications"]] == ["embeddings", "rayline"]
    assert new["applications"][0] == other
    assert new["applications"][1]["args"]["model"]["version"] == "7"
    assert new["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert target.current()["args"]["model"]["source"] == "s3://models/rayline-small/v7"


def test_restore_puts_the_previous_app_back(gpu_cfg):
    previous = render_serve_config(gpu_cfg, ServedModel(source="s3://m/v6", ref="models:/rayline-small/6",
                                                        name="rayline-small", version="6"))["applications"][0]
    api = FakeCustomObjects(rayservice({"applications": [previous]}))
    target = KubeRayService("rayline", "rayline-serve", "ml", api=api)
    target.apply(render_serve_config(gpu_cfg, MODEL))
    target.restore(previous)
    assert yaml.safe_load(api.obj["spec"]["serveConfigV2"])["applications"] == [previous]


def test_status_waits_for_the_operator_then_reads_application_status():
    status = {"observedGeneration": 2, "activeServiceStatus": {"applicationStatuses": {"rayline": {
        "status": "RUNNING", "serveDeploymentStatuses": {"LLMServer:rayline": {"status": "HEALTHY"}}}}}}
    api = FakeCustomObjects(rayservice({"applications": []}, status, generation=3))
    target = KubeRayService("rayline", "rayline-serve", "ml", api=api)
    assert target.state().status == "DEPLOYING"  # generation 3 not observed yet: statuses are stale
    status["observedGeneration"] = 3
    st = target.state()
    assert st.status == "RUNNING" and st.deployments["LLMServer:rayline"]["status"] == "HEALTHY"
    status["activeServiceStatus"]["applicationStatuses"]["rayline"]["serveDeploymentStatuses"]["LLMServer:rayline"] = {
        "status": "DEPLOY_FAILED", "message": "replica failed to start"}
    assert "LLMServer:rayline" in target.state().replica_failure()


def test_unknown_rayservice_is_a_deploy_error_naming_it():
    api = FakeCustomObjects(rayservice({"applications": []}))
    with pytest.raises(DeployError, match="RayService ml/missing"):
        KubeRayService("rayline", "missing", "ml", api=api).current()


def test_merge_keeps_other_apps_and_takes_our_options():
    mine = {"http_options": {"host": "127.0.0.1", "port": 8010}, "applications": [{"name": "a", "import_path": "x:y"}]}
    running = [{"name": "b", "import_path": "q:r"}, {"name": "a", "import_path": "old:old"}]
    merged = merge_application(mine, running, base={"proxy_location": "HeadOnly"})
    assert merged["applications"] == [running[0], mine["applications"][0]]
    assert merged["proxy_location"] == "HeadOnly" and merged["http_options"]["port"] == 8010


def test_replica_failure_is_found_in_deployment_messages():
    healthy = AppState("DEPLOYING", deployments={"LLMServer:rayline": {"status": "UPDATING", "message": ""}})
    assert healthy.replica_failure() is None
    failing = AppState("DEPLOYING", deployments={"LLMServer:rayline": {
        "status": "UPDATING", "message": "A replica failed to start with exception. Retrying 2 more time(s)."}})
    assert failing.replica_failure().startswith("LLMServer:rayline: A replica failed to start")


def test_dashboard_url_comes_from_ray_address(monkeypatch):
    monkeypatch.delenv("RAYLINE_DASHBOARD_URL", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8275")
    assert dashboard_url() == "http://127.0.0.1:8275"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a GCS address is not the dashboard
    assert dashboard_url() == "http://127.0.0.1:8265"
    assert dashboard_url("http://h:1/") == "http://h:1"
    # Inside a Ray job RAY_ADDRESS is the GCS; the stack's dashboard comes in RAYLINE_DASHBOARD_URL.
    monkeypatch.setenv("RAYLINE_DASHBOARD_URL", "http://127.0.0.1:8275/")
    assert dashboard_url() == "http://127.0.0.1:8275"


# ---- LocalServe against the test stack's Ray dashboard (token auth on), with a tiny Serve app ----
# In order: A and B deployed, A updated and restored, B replaced by a config whose replica fails, B deleted.

ECHO = "tests.serve.echo_app:build"
APP_A, APP_B = "rayline-test-target-a", "rayline-test-target-b"


def echo_config(port: int, name: str, **args) -> dict:
    """A `serve deploy` config of the echo app at /<name>, answering args['message']."""
    return {"http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": name, "route_prefix": f"/{name}", "import_path": ECHO, "args": args}]}


def wait_for(target: LocalServe, done, timeout_s: float = 180) -> AppState:
    deadline = time.time() + timeout_s
    while not done(st := target.state()):
        assert time.time() < deadline, f"{target.describe()} still {st.status}: {st.message} {st.deployments}"
        time.sleep(0.5)
    return st


def answer(stack, name: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.serve_port}/{name}", timeout=30) as r:
        return json.loads(r.read())


def wait_for_answer(stack, name: str, message: str, timeout_s: float = 180) -> None:
    """Until the app at /<name> answers `message` (a rolling update replaces the replica some time after the PUT)."""
    deadline = time.time() + timeout_s
    while (got := answer(stack, name)) != {"message": message}:
        assert time.time() < deadline, f"/{name} still answers {got}, not {message!r}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def dashboard(local_stack):
    """The test stack's dashboard URL; the echo apps are removed at the end."""
    url = f"http://127.0.0.1:{local_stack.dashboard_port}"
    yield url
    for app in (APP_A, APP_B):
        LocalServe(app, url).delete()


@pytest.mark.slow  # starts Serve on the test stack
def test_local_apply_deploys_our_app_and_keeps_the_others(local_stack, dashboard):
    a, b = LocalServe(APP_A, dashboard), LocalServe(APP_B, dashboard)  # the stack's token, from RAY_AUTH_TOKEN_PATH
    t = time.time()
    a.apply(echo_config(local_stack.serve_port, APP_A, message="a1"))
    st = wait_for(a, lambda s: s.status == "RUNNING")
    assert st.deployments == {"Echo": {"status": "HEALTHY", "message": ""}}
    assert st.app_config == echo_config(local_stack.serve_port, APP_A, message="a1")["applications"][0]
    assert t - 1 <= st.deployed_at <= time.time()
    b.apply(echo_config(local_stack.serve_port, APP_B, message="b1"))
    wait_for(b, lambda s: s.status == "RUNNING")
    assert answer(local_stack, APP_A) == {"message": "a1"} and answer(local_stack, APP_B) == {"message": "b1"}
    assert a.state().status == "RUNNING" and a.current() == st.app_config  # B's PUT carried A along


@pytest.mark.slow
def test_local_restore_puts_the_previous_app_back(local_stack, dashboard):
    a = LocalServe(APP_A, dashboard)
    previous = a.current()
    assert previous["args"] == {"message": "a1"}
    a.apply(echo_config(local_stack.serve_port, APP_A, message="a2"))
    wait_for_answer(local_stack, APP_A, "a2")
    assert a.current()["args"] == {"message": "a2"}
    a.restore(previous)
    wait_for_answer(local_stack, APP_A, "a1")
    assert wait_for(a, lambda s: s.status == "RUNNING").app_config == previous
    assert LocalServe(APP_B, dashboard).state().status == "RUNNING"


@pytest.mark.slow
def test_local_replica_that_cannot_start_is_reported_and_the_others_keep_serving(local_stack, dashboard):
    b = LocalServe(APP_B, dashboard)
    b.apply(echo_config(local_stack.serve_port, APP_B, message="b2", fail=True))
    st = wait_for(b, lambda s: s.replica_failure() is not None)
    failure = st.replica_failure()
    assert failure.startswith("Echo: ") and "echo replica told to fail (message 'b2')" in failure, failure
    assert wait_for(b, lambda s: s.status == "DEPLOY_FAILED").deployments["Echo"]["status"] == "DEPLOY_FAILED"
    assert answer(local_stack, APP_A) == {"message": "a1"}


@pytest.mark.slow
def test_local_delete_removes_only_our_app_and_an_absent_one_changes_nothing(local_stack, dashboard):
    a, b = LocalServe(APP_A, dashboard), LocalServe(APP_B, dashboard)
    b.delete()
    wait_for(b, lambda s: s.status == "NOT_STARTED")
    assert a.state().status == "RUNNING" and answer(local_stack, APP_A) == {"message": "a1"}
    before = a._details()
    LocalServe("rayline-test-never-deployed", dashboard).delete()
    after = a._details()
    assert (after["applications"].keys(), after["http_options"], after["controller_info"]) == (
        before["applications"].keys(), before["http_options"], before["controller_info"])
    assert after["applications"][APP_A]["last_deployed_time_s"] == before["applications"][APP_A]["last_deployed_time_s"]


@pytest.mark.slow
def test_local_wrong_or_missing_token_is_refused_by_name(dashboard):
    with pytest.raises(DeployError, match=r"GET .*/api/serve/applications/: HTTP 403: Forbidden: Invalid authentication token"):
        LocalServe(APP_A, dashboard, token="not-the-token").state()
    with pytest.raises(DeployError, match=r"HTTP 401: Unauthorized: Missing authentication token"):
        LocalServe(APP_A, dashboard, token="").state()
    with pytest.raises(DeployError, match=r"is the Ray dashboard up\?"):
        LocalServe(APP_A, "http://127.0.0.1:9", token="x", timeout_s=5).state()


# KubeRayService against the API server stand-in (tests/serve/kube_api.py): merge patches, resourceVersion and
# generation bumps, 409 on a stale resourceVersion, 403/404/422 as ApiExceptions, writes checked against the CRD.

def shipped_rayservice() -> dict:
    """The RayService the project renders (rayjobs/rendered/serve-gpu.yaml), as `kubectl apply` would have created it."""
    return next(d for d in yaml.safe_load_all(open("rayjobs/rendered/serve-gpu.yaml")) if d)


def serve_apps(api, name: str) -> list[dict]:
    return yaml.safe_load(api.store[("rayline", name)]["spec"]["serveConfigV2"])["applications"]


@pytest.fixture()
def standin():
    from tests.serve.kube_api import KubeApiStandIn

    obj = shipped_rayservice()
    return KubeApiStandIn(obj), obj["metadata"]["name"]


def test_apply_is_a_merge_patch_at_the_version_read_and_bumps_the_generation(standin, gpu_cfg):
    api, name = standin
    before = api.store[("rayline", name)]["metadata"]
    target = KubeRayService("rayline", name, "rayline", api=api)
    target.apply(render_serve_config(gpu_cfg, MODEL))
    (body,) = api.writes
    assert body["metadata"] == {"resourceVersion": before["resourceVersion"]}  # the version it was computed from
    after = api.store[("rayline", name)]["metadata"]
    assert after["generation"] == before["generation"] + 1 and after["resourceVersion"] != before["resourceVersion"]
    assert serve_apps(api, name)[0]["args"]["model"]["version"] == "7"
    assert target.state().status == "DEPLOYING"  # the operator has not observed generation 2 yet
    api.operator_observes("rayline", name, {"activeServiceStatus": {"applicationStatuses": {
        "rayline": {"status": "RUNNING", "serveDeploymentStatuses": {}}}}})
    assert target.state().status == "RUNNING"


def test_a_concurrent_writers_change_is_kept(standin, gpu_cfg):
    """Another client adds an app between our read and our patch: the API server refuses our stale patch (409),
    and the next attempt merges into their version, so both changes stand."""
    api, name = standin
    other = {"name": "embeddings", "route_prefix": "/embed", "import_path": "emb.app:build"}

    def add_other(obj):
        config = yaml.safe_load(obj["spec"]["serveConfigV2"])
        config["applications"].append(other)
        obj["spec"]["serveConfigV2"] = yaml.safe_dump(config)

    patch = api.patch_namespaced_custom_object

    def racing_patch(*args, **kwargs):
        if not api.refused:  # once: the other writer gets in first
            api.write_as_another_client("rayline", name, add_other)
        return patch(*args, **kwargs)

    api.patch_namespaced_custom_object = racing_patch
    KubeRayService("rayline", name, "rayline", api=api).apply(render_serve_config(gpu_cfg, MODEL))
    assert api.refused == [409] and len(api.writes) == 1
    apps = serve_apps(api, name)
    assert [a["name"] for a in apps] == ["embeddings", "rayline"] and apps[0] == other
    assert apps[1]["args"]["model"]["version"] == "7"


def test_a_writer_that_always_wins_ends_in_a_deploy_error(standin, gpu_cfg):
    api, name = standin
    patch = api.patch_namespaced_custom_object

    def always_racing(*args, **kwargs):
        api.write_as_another_client("rayline", name, lambda obj: obj["metadata"].setdefault("labels", {}).update(x="y"))
        return patch(*args, **kwargs)

    api.patch_namespaced_custom_object = always_racing
    with pytest.raises(DeployError, match="changed under each of 5 attempts"):
        KubeRayService("rayline", name, "rayline", api=api).apply(render_serve_config(gpu_cfg, MODEL))
    assert api.refused == [409] * 5 and api.writes == []


def test_forbidden_and_missing_are_explained(gpu_cfg):
    from tests.serve.kube_api import KubeApiStandIn

    obj = shipped_rayservice()
    name = obj["metadata"]["name"]
    read_only = KubeApiStandIn(obj, verbs=("get",))
    with pytest.raises(DeployError, match=r"patch refused: HTTP 403 Forbidden: .*cannot patch resource "
                                          r"\"rayservices\".*rayjobs/rendered/rbac/rollout-rbac.yaml"):
        KubeRayService("rayline", name, "rayline", api=read_only).apply(render_serve_config(gpu_cfg, MODEL))
    with pytest.raises(DeployError, match=r"RayService rayline/absent .*: get refused: HTTP 404 Not Found: "
                                          r"rayservices.ray.io \"absent\" not found \(no such RayService"):
        KubeRayService("rayline", "absent", "rayline", api=KubeApiStandIn(obj)).current()


def test_the_standin_refuses_what_the_crd_refuses_and_stores_nothing(standin):
    from kubernetes.client.exceptions import ApiException

    api, name = standin
    before = json.dumps(api.store[("rayline", name)], sort_keys=True)
    with pytest.raises(ApiException) as refused:
        api.patch_namespaced_custom_object("ray.io", "v1", "rayline", "rayservices", name,
                                           {"spec": {"rayClusterConfig": {"headGroupSpec": {"rayStartParams": 7}}}})
    assert refused.value.status == 422
    assert "spec.rayClusterConfig.headGroupSpec.rayStartParams" in json.loads(refused.value.body)["message"]
    assert json.dumps(api.store[("rayline", name)], sort_keys=True) == before and api.writes == []
    # A merge patch: null deletes a key, objects merge, and status (a subresource) is not written this way.
    api.patch_namespaced_custom_object("ray.io", "v1", "rayline", "rayservices", name,
                                       {"metadata": {"labels": {"team": "ml", "app.kubernetes.io/name": None}},
                                        "status": {"serviceStatus": "Running"}})
    stored = api.store[("rayline", name)]
    assert stored["metadata"]["labels"] == {"app.kubernetes.io/component": "serve", "team": "ml"}
    assert not stored.get("status")
