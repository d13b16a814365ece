"""Preflight of rayline's own RayService: its serving config's engine section against the cluster it is rendered with.

Each test renders the shipped GPU serving config (configs/serve/gpu_example.yaml: TP 2 on L4, 1-4 replicas; one
worker pod of 8 GPUs) the way `python -m pipelines.render` does, then changes the engine inside `serveConfigV2`
as a hand edit (or a cluster sized for another config) would. Preflight must name the field that cannot work.
"""

from __future__ import annotations

import pytest
import yaml

from rayjobs import render, stages
from rayjobs.preflight import check_preflight, engines_that_fit, pod_shapes

ROOT = stages.PROJECT_ROOT
APP = "spec.serveConfigV2.applications[0]"
ENGINE = f"{APP}.args.config.engine"


@pytest.fixture(scope="module")
def rendered() -> dict:
    return render.render("serve", str(ROOT / "configs/serve/gpu_example.yaml"), render.load_profile(None))


def edited(doc: dict, engine: dict | None = None, **config) -> dict:
    """`doc` with the rayline app's `args.config.engine` (and other `args.config` keys) changed in serveConfigV2."""
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    cfg = serve["applications"][0]["args"]["config"]
    cfg["engine"].update(engine or {})
    cfg.update(config)
    return {**doc, "spec": {**doc["spec"], "serveConfigV2": yaml.safe_dump(serve)}}


def problems_at(doc: dict) -> dict[str, str]:
    return {p.path: p.message for p in check_preflight(doc)}


def test_the_rendered_gpu_service_passes(rendered):
    assert check_preflight(rendered) == []
    # One worker pod of 8 GPUs holds four TP-2 engines: exactly autoscaling.max_replicas.
    assert engines_that_fit([{"CPU": 2.0, "GPU": 1.0}] * 2, pod_shapes(rendered["spec"]["rayClusterConfig"])) == 4


@pytest.mark.parametrize("tp, pp", [(16, 1), (4, 4)])
def test_an_engine_wider_than_any_pod_is_named(rendered, tp, pp):
    problems = problems_at(edited(rendered, {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}))
    msg = problems[f"{ENGINE}.tensor_parallel_size"]
    assert f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}" in msg
    assert f"STRICT_PACK puts all {tp * pp} bundles on one node" in msg and "GPU 16" in msg
    assert "gpu-workers: CPU 64, GPU 8" in msg and "stay pending" in msg


def test_gpus_per_engine_times_cpus_must_fit_too(rendered):
    problems = problems_at(edited(rendered, {"cpus_per_engine": 40}))  # 2 x 40 CPUs > the pod's 64
    assert "CPU 80, GPU 2" in problems[f"{ENGINE}.tensor_parallel_size"]


def test_a_shape_the_serving_config_refuses_is_named_at_its_field(rendered):
    problems = problems_at(edited(rendered, {"accelerator": "cpu", "accelerator_type": None, "kv_cache_memory_bytes": 2**27}))
    assert "the CPU engine runs one worker" in problems[f"{ENGINE}.tensor_parallel_size"]
    problems = problems_at(edited(rendered, {"tensor_parallel_size": 0}))
    assert "must be >= 1, got 0" in problems[f"{ENGINE}.tensor_parallel_size"]
    problems = problems_at(edited(rendered, {"tensor_paralel_size": 2}))
    assert "unknown field" in problems[f"{ENGINE}.tensor_paralel_size"]
    assert all("serve.online.app:build_app refuses" in m for m in problems.values())


def test_more_replicas_than_the_pods_hold(rendered):
    problems = problems_at(edited(rendered, autoscaling={"min_replicas": 1, "max_replicas": 6}))
    assert list(problems) == [f"{APP}.args.config.autoscaling.max_replicas"]
    assert "6 engine replicas" in problems[f"{APP}.args.config.autoscaling.max_replicas"]
    assert "at most 4 at once" in problems[f"{APP}.args.config.autoscaling.max_replicas"]
    problems = problems_at(edited(rendered, autoscaling={"min_replicas": 5, "max_replicas": 5}))
    assert "never become RUNNING" in problems[f"{APP}.args.config.autoscaling.min_replicas"]
    # TP 4: two engines per pod, so the shipped max_replicas 4 no longer fits.
    problems = problems_at(edited(rendered, {"tensor_parallel_size": 4}))
    assert "at most 2 at once" in problems[f"{APP}.args.config.autoscaling.max_replicas"]


def test_an_accelerator_type_no_group_provides(rendered):
    problems = problems_at(edited(rendered, {"accelerator_type": "H100"}))  # the workers select NVIDIA-L4 nodes
    assert "'H100' is on no worker group" in problems[f"{ENGINE}.accelerator_type"]


def test_gpu_memory_is_checked_with_the_engine_settings(rendered):
    doc = edited(rendered)
    doc["metadata"] = {**doc["metadata"], "annotations": {
        **doc["metadata"]["annotations"], "rayline.io/model-params": "8B", "rayline.io/model-layers": "32",
        "rayline.io/model-kv-heads": "8", "rayline.io/model-head-dim": "128"}}
    assert problems_at(doc) == {}  # 8B over TP 2 on 24 GiB L4s: 7.5 GiB of weights per GPU
    msg = problems_at(edited(doc, {"tensor_parallel_size": 1, "max_model_len": 131072}))[ENGINE]
    assert "model does not fit GPU memory" in msg and "131072-token sequence" in msg and "TP 1" in msg


def test_ingress_deployment_cpus_must_fit_a_pod(rendered):
    problems = problems_at(edited(rendered, ingress="deployment", ingress_cpus=128))
    assert "no pod offers that" in problems[f"{APP}.args.config.ingress_cpus"]
