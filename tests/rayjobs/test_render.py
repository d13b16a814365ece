"""Rendering: shipped manifests are current and pass every validation layer; laptop and cluster agree."""

import shlex

import pytest
import yaml

from core.config import ConfigError
from rayjobs import render, stages
from rayjobs.cluster_profile import RAY_VERSION
from rayjobs.manifests import Shape, cluster_spec
from rayjobs.roles import get_role
from rayjobs.validate import validate_manifest

ROOT = stages.PROJECT_ROOT


@pytest.fixture(scope="module")
def profile():
    return render.load_profile(None)


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_shipped_manifest_is_current_and_valid(fname, profile, tmp_path):
    stage, config = render.SHIPPED[fname]
    problems = render.render_to_file(stage, str(ROOT / config), tmp_path / fname, profile)
    assert problems == []
    shipped = ROOT / "rayjobs" / "rendered" / fname
    assert shipped.exists(), f"rayjobs/{fname} missing: run `python -m pipelines.render --shipped`"
    docs = list(yaml.safe_load_all(shipped.read_text()))
    assert docs == list(yaml.safe_load_all((tmp_path / fname).read_text())), (
        f"rayjobs/{fname} is stale: run `python -m pipelines.render --shipped`")
    assert [d["kind"] for d in docs] == [stages.get_stage(stage).kind, "NetworkPolicy"]


@pytest.mark.parametrize("fname", sorted(render.PLATFORM))
def test_shipped_namespace_objects_are_current_and_valid(fname, profile, tmp_path):
    assert render.render_platform(tmp_path, profile)[fname] == []
    shipped = ROOT / "rayjobs" / "rendered" / fname
    assert list(yaml.safe_load_all(shipped.read_text())) == list(yaml.safe_load_all((tmp_path / fname).read_text())), (
        f"rayjobs/{fname} is stale: run `python -m pipelines.render --shipped`")


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_manifest_security_and_versions(fname, profile):
    stage, config = render.SHIPPED[fname]
    doc = render.render(stage, str(ROOT / config), profile)
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == RAY_VERSION and cluster["authOptions"] == {"mode": "token"}
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    role = get_role(stages.get_stage(stage).role)
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == role.service_account
        for c in pod["spec"]["containers"]:
            assert RAY_VERSION in c["image"].rsplit(":", 1)[1]
            secretish = [e for e in c["env"] if any(w in e["name"] for w in ("SECRET", "TOKEN", "PASSWORD", "KEY_ID"))]
            assert secretish and all("valueFrom" in e and "value" not in e for e in secretish)
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}} in pod["spec"]["volumes"]
    if doc["kind"] == "RayJob":
        spec = doc["spec"]
        assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
        # The RayJob runs exactly what `pipelines.submit` runs from a laptop.
        assert spec["entrypoint"] == stages.entrypoint(stages.get_stage(stage), ROOT / config)
        assert shlex.split(spec["entrypoint"])[:3] == ["python", "-m", stages.get_stage(stage).module]


def test_gpu_train_packs_workers_onto_gpu_nodes(profile):
    doc = render.render("train", str(ROOT / "configs/train/small_gpu.yaml"), profile)
    group = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] * group["replicas"] >= 8
    assert group["template"]["spec"]["nodeSelector"] == profile.gpu.node_selectors["H100"]


@pytest.mark.parametrize("stage, config, overrides, grace", [
    ("train", "configs/train/tiny.yaml", [], 30), ("train", "configs/train/tiny.yaml", ["checkpoint.notice_grace_s=95"], 95),
    ("train", "configs/train/small_gpu.yaml", [], 90), ("tune", "configs/tune/tiny.yaml", [], 30)])
def test_training_worker_pods_drain_for_the_configured_grace_before_kubernetes_kills_them(stage, config, overrides,
                                                                                          grace, profile):
    """A worker pod given notice (a spot reclaim, a deletion): Ray drains its node for checkpoint.notice_grace_s (the
    ranks checkpoint meanwhile, train/notice.py), and Kubernetes waits that and the processes' stop before SIGKILL."""
    from rayjobs.manifests import DRAIN_TIMEOUT_ENV, STOP_MARGIN_S

    doc = render.render(stage, str(ROOT / config), profile, overrides)
    assert validate_manifest(doc, project_root=ROOT, profile=profile) == []
    cluster = doc["spec"]["rayClusterSpec"]
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == grace + STOP_MARGIN_S
        assert {"name": DRAIN_TIMEOUT_ENV, "value": str(grace)} in spec["containers"][0]["env"]
    head = cluster["headGroupSpec"]["template"]["spec"]  # the driver's pod: no rank checkpoints there
    assert "terminationGracePeriodSeconds" not in head
    assert DRAIN_TIMEOUT_ENV not in {e["name"] for e in head["containers"][0]["env"]}


def test_serving_pods_keep_the_default_grace(profile):
    from rayjobs.manifests import DRAIN_TIMEOUT_ENV

    serving = render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), profile)
    for group in serving["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert "terminationGracePeriodSeconds" not in group["template"]["spec"]
        assert DRAIN_TIMEOUT_ENV not in {e["name"] for e in group["template"]["spec"]["containers"][0]["env"]}


def test_gpu_serving_lands_on_its_accelerator(profile):
    doc = render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), profile)
    cfg = render.load_config(stages.config_class(stages.get_stage("serve")), ROOT / "configs/serve/gpu_example.yaml")
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["template"]["spec"]["nodeSelector"] == profile.gpu.node_selectors[cfg.engine.accelerator_type]
    per_pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert per_pod % cfg.engine.tensor_parallel_size == 0  # an engine never spans pods


def test_serving_pods_carry_serve_request_path_settings_and_jobs_do_not(profile):
    from core.ray_env import SERVE_PROCESS_ENV

    def pod_envs(doc):
        cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
        pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        return [{e["name"]: e.get("value") for e in c["env"]} for p in pods for c in p["spec"]["containers"]]

    serving = render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), profile)
    # Controller and proxy run on the head, replicas on the workers: every pod reads them when Serve starts.
    assert all(env.items() >= SERVE_PROCESS_ENV.items() for env in pod_envs(serving))
    job = render.render("train", str(ROOT / "configs/train/small_gpu.yaml"), profile)
    assert all(not (env.keys() & SERVE_PROCESS_ENV.keys()) for env in pod_envs(job))


def test_unknown_accelerator_is_named(profile):
    with pytest.raises(ConfigError, match="no node selector for accelerator type 'TPU9'"):
        render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), profile, ["engine.accelerator_type=TPU9"])


def test_unsatisfiable_shape_is_rejected(profile):
    """A hand-built cluster whose pods have 1 GPU cannot hold a TP=2 STRICT_PACK engine: preflight says so."""
    serve_config = {"applications": [{"name": "llm", "route_prefix": "/", "import_path": "core.config:load_config",
                                      "deployments": [{"name": "LLMServer", "placement_group_bundles": [{"GPU": 1}, {"GPU": 1}],
                                                       "placement_group_strategy": "STRICT_PACK"}]}]}
    from rayjobs.manifests import rayservice

    doc = rayservice("bad", serve_config, Shape(workers=2, gpus_per_worker=1), profile)
    problems = validate_manifest(doc, project_root=ROOT)
    assert any("placement" in p.message.lower() for p in problems), problems


def test_image_without_pinned_ray_is_refused():
    with pytest.raises(ConfigError, match="image: 'rayproject/ray:2.9.0-py311': the tag must carry the pinned Ray"):
        render.load_profile(None, image="rayproject/ray:2.9.0-py311")


def test_config_outside_project_is_refused(tmp_path, profile):
    cfg = tmp_path / "x.yaml"
    cfg.write_text((ROOT / "configs/data/sample.yaml").read_text())
    with pytest.raises(ValueError, match="must live inside the project"):
        render.render("data", str(cfg), profile)


def test_cluster_spec_head_carries_no_work(profile):
    spec = cluster_spec(Shape(workers=3), profile)
    assert spec["workerGroupSpecs"][0]["replicas"] == 3 and spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def _worker_group(doc: dict) -> dict:
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    return cluster["workerGroupSpecs"][0]


def test_serving_with_a_replica_range_autoscales_pods_with_autoscaler_v2(profile):
    # CPU engines: one pod per replica, so min_replicas=1, max_replicas=3 is a 1..3 pod group.
    doc = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), profile,
                        ["autoscaling.min_replicas=1", "autoscaling.max_replicas=3"])
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"].items() >= {
        "version": "v2", "idleTimeoutSeconds": profile.autoscaling.idle_timeout_s,
        "upscalingMode": profile.autoscaling.upscaling_mode}.items()
    group = _worker_group(doc)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 3)
    assert validate_manifest(doc) == []
    fixed = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), profile,
                          ["autoscaling.min_replicas=2", "autoscaling.max_replicas=2"])
    assert "enableInTreeAutoscaling" not in fixed["spec"]["rayClusterConfig"]
    assert "autoscalerOptions" not in fixed["spec"]["rayClusterConfig"]


def test_jobs_autoscale_from_the_profiles_minimum_when_asked(profile):
    import dataclasses

    config = str(ROOT / "configs/train/tiny.yaml")
    full = _worker_group(render.render("train", config, profile))
    assert "enableInTreeAutoscaling" not in render.render("train", config, profile)["spec"]["rayClusterSpec"]
    auto = dataclasses.replace(profile, autoscaling=dataclasses.replace(
        profile.autoscaling, jobs=True, min_job_workers=0, idle_timeout_s=120, upscaling_mode="Conservative"))
    doc = render.render("train", config, auto)
    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"].items() >= {"version": "v2", "idleTimeoutSeconds": 120,
                                                    "upscalingMode": "Conservative"}.items()
    group = _worker_group(doc)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (0, 0, full["maxReplicas"])
    assert validate_manifest(doc) == []
    # The rollout job needs no workers: nothing to scale.
    rollout = render.render("rollout", str(ROOT / "configs/rollout/tiny.yaml"), auto)
    assert "enableInTreeAutoscaling" not in rollout["spec"]["rayClusterSpec"]


def test_an_elastic_run_gets_a_worker_group_that_scales_between_its_min_and_max(profile):
    """scaling.num_workers: [min, max]: the cluster starts with min worker pods and its autoscaler adds pods up to max
    as Ray Train asks for them (train/config.py ScalingConfig.num_workers)."""
    doc = render.render("train", str(ROOT / "configs/train/tiny.yaml"), profile, ["scaling.num_workers=[1, 2]"])
    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"
    group = _worker_group(doc)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 2)
    assert validate_manifest(doc, project_root=ROOT, profile=profile) == []
    gpu = _worker_group(render.render("train", str(ROOT / "configs/train/small_gpu.yaml"), profile,
                                      ["scaling.num_workers=[8, 16]"]))
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8  # whole H100 nodes
    assert (gpu["minReplicas"], gpu["maxReplicas"]) == (1, 2)


def test_autoscaler_settings_the_validator_refuses_are_named(profile):
    doc = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), profile,
                        ["autoscaling.min_replicas=1", "autoscaling.max_replicas=3"])
    _worker_group(doc)["template"]["spec"]["restartPolicy"] = "Always"  # autoscaler v2 removes pods itself
    problems = validate_manifest(doc)
    assert any("restartPolicy" in str(p) and "autoscaler V2" in str(p) for p in problems), problems
    _worker_group(doc)["template"]["spec"].pop("restartPolicy")
    _worker_group(doc).update(minReplicas=4)  # above maxReplicas 3
    assert any("minReplicas 4 greater than maxReplicas 3" in str(p) for p in validate_manifest(doc))


@pytest.mark.parametrize("key, value", [("autoscaling.idle_timeout_s", "-1"), ("autoscaling.min_job_workers", "-2"),
                                        ("autoscaling.upscaling_mode", "Fast")])
def test_bad_autoscaling_profile_is_named(key, value):
    from rayjobs.cluster_profile import Profile

    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        render.load_config(Profile, render.DEFAULT_PROFILE, [f"{key}={value}"])


def test_gcs_fault_tolerance_goes_on_the_rayservice_with_the_password_by_reference(profile):
    import dataclasses

    ft = dataclasses.replace(profile.gcs_fault_tolerance, redis_address="redis.rayline.svc.cluster.local:6379",
                             external_storage_namespace="rayline-serve")
    with_ft = dataclasses.replace(profile, gcs_fault_tolerance=ft)
    doc = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), with_ft)
    assert doc["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.rayline.svc.cluster.local:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "rayline-redis", "key": "password"}}},
        "externalStorageNamespace": "rayline-serve"}
    assert validate_manifest(doc) == []
    # KubeRay refuses the old way beside it: the Redis address also in the head's env.
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"].append({"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"})
    assert any("RAY_REDIS_ADDRESS" in str(p) for p in validate_manifest(doc))
    # Off by default, and never on a job's one-off cluster.
    assert "gcsFaultToleranceOptions" not in render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"),
                                                           profile)["spec"]["rayClusterConfig"]
    assert "gcsFaultToleranceOptions" not in render.render("train", str(ROOT / "configs/train/tiny.yaml"),
                                                           with_ft)["spec"]["rayClusterSpec"]


@pytest.mark.parametrize("address", ["redis", "redis:port", ":6379", "redis:70000"])
def test_bad_redis_address_is_named(address):
    from rayjobs.cluster_profile import Profile

    with pytest.raises(ConfigError, match="redis_address"):
        render.load_config(Profile, render.DEFAULT_PROFILE, [f"gcs_fault_tolerance.redis_address={address}"])
