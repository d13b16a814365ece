"""The DPO stage renders as a RayJob that passes rayline's offline validation, and runs what a laptop submits."""

from __future__ import annotations

import shlex

from rayjobs import render, stages
from rayjobs.roles import get_role
from rayjobs.validate import validate_manifest

ROOT = stages.PROJECT_ROOT
CONFIG = str(ROOT / "configs/post_train/dpo_tiny.yaml")


def test_dpo_renders_as_a_valid_rayjob_run_as_the_trainer_with_a_pod_per_worker():
    profile = render.load_profile(None)
    doc = render.render("dpo", CONFIG, profile)
    assert doc["kind"] == "RayJob" and validate_manifest(doc, project_root=ROOT) == []
    spec = doc["spec"]
    assert spec["entrypoint"] == stages.entrypoint(stages.get_stage("dpo"), CONFIG)
    assert shlex.split(spec["entrypoint"])[:5] == ["python", "-m", "pipelines.dpo", "--config",
                                                   "configs/post_train/dpo_tiny.yaml"]
    cluster = spec["rayClusterSpec"]
    assert sum(g["replicas"] for g in cluster["workerGroupSpecs"]) == 2  # scaling.num_workers
    trainer = get_role("trainer")
    for pod in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        assert pod["spec"]["serviceAccountName"] == trainer.service_account
        assert all({"name": "RAYLINE_ROLE", "value": "trainer"} in c["env"] for c in pod["spec"]["containers"])


def test_dpo_render_with_overrides_keeps_them_on_the_entrypoint():
    doc = render.render("dpo", CONFIG, render.load_profile(None), ["dpo.beta=0.5", "lora.enabled=true"])
    assert shlex.split(doc["spec"]["entrypoint"])[-2:] == ["dpo.beta=0.5", "lora.enabled=true"]
    assert validate_manifest(doc, project_root=ROOT) == []


def test_a_search_over_dpo_settings_renders_as_a_valid_rayjob_sized_from_the_dpo_config():
    config = str(ROOT / "configs/tune/dpo_tiny.yaml")
    doc = render.render("tune", config, render.load_profile(None))
    assert doc["kind"] == "RayJob" and validate_manifest(doc, project_root=ROOT) == []
    assert shlex.split(doc["spec"]["entrypoint"])[:5] == ["python", "-m", "pipelines.tune", "--config",
                                                          "configs/tune/dpo_tiny.yaml"]
    assert sum(g["replicas"] for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]) == 2  # the DPO config's workers
