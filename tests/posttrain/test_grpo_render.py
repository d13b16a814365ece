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
    # A reward model's engines get a worker each beside the roles'.
    scored = render.render("grpo", config, profile, ["reward.name=model", "reward.model=models:/rm@champion",
                                                     "reward.num_engines=2"])
    assert validate_manifest(scored, profile=profile) == []
    assert sum(g["replicas"] for g in scored["spec"]["rayClusterSpec"]["workerGroupSpecs"]) == 3


def test_a_search_over_grpo_renders_a_worker_per_role_and_trial():
    """A tune search over a GRPO config gets the GRPO stage's worker group once per trial running at once."""
    profile = render.load_profile(None)
    config = str(ROOT / "configs" / "tune" / "grpo_tiny.yaml")
    doc = render.render("tune", config, profile)
    assert doc["spec"]["entrypoint"] == "python -m pipelines.tune --config configs/tune/grpo_tiny.yaml"
    assert validate_manifest(doc, profile=profile) == []

    def workers(overrides: list[str]) -> int:
        spec = render.render("tune", config, profile, overrides)["spec"]["rayClusterSpec"]
        return sum(g["replicas"] for g in spec["workerGroupSpecs"])
    assert workers([]) == 1  # colocated roles, trials one at a time (max_concurrent_trials 0)
    assert workers(["max_concurrent_trials=2"]) == 2
    assert workers(["max_concurrent_trials=2", "post_train_overrides=[placement=separate]"]) == 4
