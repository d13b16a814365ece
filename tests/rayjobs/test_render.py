"""Rendering: shipped manifests are current and pass every validation layer; laptop and cluster agree."""

import shlex

import pytest
import yaml

from pipelines.config import ConfigError
from rayjobs import render, stages
from rayjobs.cluster_profile import RAY_VERSION
from rayjobs.manifests import Shape, cluster_spec
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
    shipped = ROOT / "rayjobs" / fname
    assert shipped.exists(), f"rayjobs/{fname} missing: run `python -m pipelines.render --shipped`"
    assert yaml.safe_load(shipped.read_text()) == yaml.safe_load((tmp_path / fname).read_text()), (
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
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == profile.service_account
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


def test_gpu_serving_lands_on_its_accelerator(profile):
    doc = render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), profile)
    cfg = render.load_config(stages.config_class(stages.get_stage("serve")), ROOT / "configs/serve/gpu_example.yaml")
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["template"]["spec"]["nodeSelector"] == profile.gpu.node_selectors[cfg.engine.accelerator_type]
    per_pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert per_pod % cfg.engine.tensor_parallel_size == 0  # an engine never spans pods


def test_serving_pods_carry_serve_request_path_settings_and_jobs_do_not(profile):
    from pipelines.ray_env import SERVE_PROCESS_ENV

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
    serve_config = {"applications": [{"name": "llm", "route_prefix": "/", "import_path": "pipelines.config:load_config",
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
