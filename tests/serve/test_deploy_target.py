"""Deploy targets without a cluster: the RayService patch body (fake CustomObjectsApi), app merging, status parsing."""

from __future__ import annotations

import pytest
import yaml

from pipelines.config import load_config
from serve.app import ServedModel, render_serve_config
from serve.deploy_target import AppState, DeployError, KubeRayService, LocalServe, dashboard_url, merge_application
from serve.serve_config import Config

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
    old_app = {"name": "rayline", "route_prefix": "/", "import_path": "serve.app:build_app", "args": {"model": None}}
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


class FakeDashboard:
    """The dashboard's /api/serve/applications/ (GET details, PUT config), recording what it was sent."""

    def __init__(self, details: dict):
        import http.server
        import json
        import threading

        self.details, self.puts, self.auth = details, [], []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, body: dict):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                fake.auth.append(self.headers.get("Authorization"))
                self._reply(fake.details)

            def do_PUT(self):  # noqa: N802
                fake.auth.append(self.headers.get("Authorization"))
                fake.puts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._reply({})

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture()
def dashboard():
    running = {"name": "other", "route_prefix": "/other", "import_path": "o:app", "args": {}}
    d = FakeDashboard({"http_options": {"host": "127.0.0.1", "port": 8010}, "applications": {
        "other": {"status": "RUNNING", "deployed_app_config": running, "deployments": {}},
        "imperative": {"status": "RUNNING", "deployed_app_config": None, "deployments": {}},
    }})
    yield d
    d.server.shutdown()


def test_local_deploy_sends_the_token_and_keeps_other_apps(dashboard, gpu_cfg):
    target = LocalServe("rayline", dashboard.url, token="tok")
    target.apply(render_serve_config(gpu_cfg, MODEL))
    (body,) = dashboard.puts
    assert [a["name"] for a in body["applications"]] == ["other", "rayline"]
    assert set(dashboard.auth) == {"Bearer tok"}
    assert target.state().status == "NOT_STARTED"  # the fake does not run it


def test_local_delete_of_an_absent_app_sends_nothing(dashboard):
    LocalServe("rayline", dashboard.url, token="tok").delete()
    assert dashboard.puts == []
    LocalServe("other", dashboard.url, token="tok").delete()
    (body,) = dashboard.puts
    assert body == {"http_options": {"host": "127.0.0.1", "port": 8010}, "applications": []}
