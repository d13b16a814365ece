"""A tune search over GRPO settings on the test stack: `python -m pipelines.tune` over a GRPO config, as the trainer
role. Each trial is a GRPO run of its own (an MLflow child run of the search's, with its sampled values), reports the
verifier's mean reward after its updates, and the best finished trial registers like a GRPO run with the search's
tags and the whole search's usage.

Lean: 2 trials of 4 updates each (8 prompts x 4 samples) from the warmed tiny policy, one at a time on the stack's
2 CPUs.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from core import registry
from posttrain.grpo.tracking import TAG_PARENT_VERSION
from stack import mlflow_auth
from stack.warm_policy import write_prompts
from tests.posttrain.searches import run_search
from train.tune import TAG_TUNE_METRIC, TAG_TUNE_SEARCH, TAG_TUNE_TRIAL

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def search(local_stack, warm_policy_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-tune")
    policy = warm_policy_dir
    production = f"rayline-test-grpo-tune-{uuid.uuid4().hex[:6]}"
    mlflow_auth.provision(registry.tracking_uri(), local_stack.state, [production])  # as `stack up` does its models
    prompts = write_prompts(tmp / "prompts.jsonl", 64, seed=1)
    cfg = yaml.safe_load((ROOT / "configs/tune/grpo_tiny.yaml").read_text())
    cfg.update({
        "search_name": f"grpo-search-{uuid.uuid4().hex[:6]}", "num_samples": 2,
        "register_as": production + mlflow_auth.CANDIDATES_SUFFIX,
        "space": {"policy.lr": {"type": "loguniform", "low": 2.0e-5, "high": 2.0e-4}},
        "asha": {"grace_period": 2, "reduction_factor": 2.0, "max_t": 0},
        "post_train_overrides": [
            f"model={policy}", f"prompts.uri={prompts}", "prompts.dataset_version=sum-tune-v1", "eval_uri=",
            f"output_uri={tmp / 'out'}", f"steps={STEPS}", "prompts_per_step=8", "group_size=4",
            "checkpoint_every=0"],
    })
    return {**run_search(cfg, tmp), "policy": str(policy), "out": tmp / "out"}


def test_each_trial_is_a_grpo_run_of_its_own_sampled_values_reporting_its_reward(search):
    trials = {t["trial_id"]: t for t in search["result"]["trials"]}
    children = search["children"]
    assert len(trials) == 2 and set(trials) == set(children)
    lrs = set()
    for trial_id, run in children.items():
        tags = run.data.tags
        assert tags[registry.TAG_STAGE] == "tune-trial" and tags[TAG_TUNE_SEARCH] == search["cfg"]["search_name"]
        assert tags[TAG_PARENT_VERSION] == search["policy"] and tags[registry.TAG_DATASET_VERSION] == "sum-tune-v1"
        assert run.data.params["policy.lr"] == str(trials[trial_id]["sampled"]["policy.lr"])
        lrs.add(run.data.params["policy.lr"])
        # What the search ranked the trial on is the reward its run logged at the last update Tune heard of.
        logged = {m.step: m.value for m in registry.client().get_metric_history(run.info.run_id, "grpo/reward_mean")}
        step = trials[trial_id]["step"]
        assert step >= 2 and trials[trial_id]["metric"] == pytest.approx(logged[step])
        if trials[trial_id]["finished"]:
            assert step == STEPS and Path(trials[trial_id]["export_uri"], "model.safetensors").exists()
            assert Path(trials[trial_id]["export_uri"]).is_relative_to(search["out"] / search["cfg"]["search_name"])
    assert len(lrs) == 2  # each trial trained with its own sampled learning rate


def test_the_best_trial_registers_like_a_grpo_run_with_the_searchs_usage(search):
    result, children = search["result"], search["children"]
    finished = [t for t in result["trials"] if t["finished"]]
    best = result["best"]
    assert finished and best["metric"] == max(t["metric"] for t in finished)
    mv = registry.client().get_model_version(result["model_name"], result["model_version"])
    tags = mv.tags
    assert tags[registry.TAG_STAGE] == "grpo"
    assert tags[TAG_PARENT_VERSION] == search["policy"] and tags[registry.TAG_DATASET_VERSION] == "sum-tune-v1"
    assert tags[TAG_TUNE_SEARCH] == search["cfg"]["search_name"] and tags[TAG_TUNE_TRIAL] == best["trial_id"]
    assert tags[TAG_TUNE_METRIC] == f"reward_mean={best['metric']:.6g}"
    assert tags[registry.TAG_WEIGHTS_DIGEST] and mv.run_id == children[best["trial_id"]].info.run_id
    # The whole search's usage (both trials' engines and policy ranks) on the search's run and the registered best.
    used = result["usage"]
    assert used["cpu_s"] - used["driver_cpu_s"] > 10.0 and used["processes"] >= 4, used
    assert tags["rayline.usage.tune_cpu_s"] == f"{used['cpu_s']:.1f}"
    assert search["parent"].data.tags[registry.TAG_STAGE] == "tune"
