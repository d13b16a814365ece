"""The GRPO stage renders as a RayJob that passes every offline validation layer, with the laptop's entry point."""

from rayjobs import render, stages
from rayjobs.validate import validate_manifest

ROOT = stages.PROJECT_ROOT


def test_grpo_renders_as_a_valid_rayjob_acting_as_the_trainer():
    profile = render.load_profile(None)
    config = str(ROOT / "configs" / "post_train" / "grpo_tiny.yaml")
    doc = render.render("grpo", config, profile)
    assert doc["kind"] == "RayJob"
    assert doc["spec"]["entrypoint"] == "python -m pipelines.grpo --config configs/post_train/grpo_tiny.yaml"
    assert validate_manifest(doc, profile=profile) == []
    workers = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert sum(g["replicas"] for g in workers) == 1  # colocated: rollout and policy take turns in one worker
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert head["rayline.io/role"] == "trainer"
    separate = render.render("grpo", config, profile, ["placement=separate", "num_engines=2"])
    assert sum(g["replicas"] for g in separate["spec"]["rayClusterSpec"]["workerGroupSpecs"]) == 3
