"""A tune search over DPO settings on the test stack: `python -m pipelines.tune` over a DPO config, as the trainer role.
The preference version and the reference's log-probs are made once on the driver and every trial trains on that one
scored version; each trial's child run carries the DPO lineage and its own beta and reports the beta-free preference
accuracy the search ranks on; the best trial registers like a DPO run.

Lean: 2 trials of 4 DPO steps each on the tiny model (64 train pairs, 16 eval pairs), one at a time on the stack's
2 CPUs.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest
import yaml

from core import registry
from posttrain import dpo_stage
from stack import mlflow_auth
from stack.preference_sample import write_preferences
from tests.posttrain.searches import run_search
from train.tune import TAG_TUNE_METRIC, TAG_TUNE_SEARCH, TAG_TUNE_TRIAL

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
METRIC = "eval_preference_accuracy"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def search(local_stack, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo-tune")
    production = f"rayline-test-dpo-tune-{uuid.uuid4().hex[:6]}"
    mlflow_auth.provision(registry.tracking_uri(), local_stack.state, [production])  # as `stack up` does its models
    pairs = write_preferences(tmp / "pairs", seed=0, n_train=64, n_eval=16)
    cfg = yaml.safe_load((ROOT / "configs/tune/dpo_tiny.yaml").read_text())
    cfg.update({
        "search_name": f"dpo-search-{uuid.uuid4().hex[:6]}", "num_samples": 2, "experiment": "rayline-tune",
        "register_as": production + mlflow_auth.CANDIDATES_SUFFIX,
        "asha": {"grace_period": 2, "reduction_factor": 2.0, "max_t": 0},
        "post_train_overrides": [
            f"model.path={tiny_model_dir}", f"preferences.inputs=[{pairs / 'train.jsonl'}]",
            f"preferences.eval_inputs=[{pairs / 'eval.jsonl'}]", f"preferences.output_uri={tmp / 'preferences'}",
            f"checkpoint.storage_path={tmp / 'runs'}", f"train.max_steps={STEPS}", "train.micro_batch_size=4",
            "train.eval_batch_size=8", "train.eval_every_steps=2", "train.checkpoint_every_steps=2"],
    })
    return {**run_search(cfg, tmp), "model": str(tiny_model_dir)}


def test_the_reference_is_scored_once_before_the_search_and_every_trial_trains_on_it(search):
    stdout, parent = search["stdout"], search["parent"]
    # One preference version, one scoring pass (fresh: the output_uri is new), both on the driver before any trial.
    scoring = [line for line in stdout.splitlines() if line.startswith("reference ")]
    assert len(scoring) == 1 and "already computed" not in scoring[0], stdout[-3000:]
    assert len([line for line in stdout.splitlines() if line.startswith("preferences ")]) == 1
    scored = Path(parent.data.tags[registry.TAG_DATASET_MANIFEST])
    assert scored.name == "manifest.json" and scored.parent.parent.name == "reference"
    assert len(list(scored.parent.parent.iterdir())) == 1  # one reference, scored into one directory
    version = parent.data.tags[dpo_stage.TAG_PREFERENCE_VERSION]
    assert version == search["result"]["lineage"][dpo_stage.TAG_PREFERENCE_VERSION]
    children = search["children"]
    assert len(children) == 2
    written_ms = scored.stat().st_mtime * 1000
    for run in children.values():
        assert run.data.tags[registry.TAG_DATASET_MANIFEST] == str(scored)
        assert run.data.tags[dpo_stage.TAG_PREFERENCE_VERSION] == version
        assert run.info.start_time > written_ms  # nothing rewrote the scored version once a trial had started
        # Each policy starts as its reference: the first eval loss is log 2 when the stored log-probs are its own.
        first = min(registry.client().get_metric_history(run.info.run_id, "eval_loss"), key=lambda m: m.step)
        assert first.step == 0 and first.value == pytest.approx(math.log(2), abs=1e-4)


def test_each_trial_run_carries_the_dpo_lineage_its_own_beta_and_the_beta_free_metric(search):
    trials = {t["trial_id"]: t for t in search["result"]["trials"]}
    children = search["children"]
    assert set(trials) == set(children)
    betas = set()
    for trial_id, run in children.items():
        tags, metrics = run.data.tags, run.data.metrics
        assert tags[registry.TAG_STAGE] == "tune-trial" and tags[TAG_TUNE_SEARCH] == search["cfg"]["search_name"]
        assert tags[dpo_stage.TAG_REFERENCE_MODEL] == search["model"] and tags[dpo_stage.TAG_REFERENCE_DIGEST]
        assert tags[dpo_stage.TAG_DPO_BETA] == str(trials[trial_id]["sampled"]["dpo.beta"])
        betas.add(tags[dpo_stage.TAG_DPO_BETA])
        assert run.data.params["optim.lr"] == str(trials[trial_id]["sampled"]["optim.lr"])
        assert 0.0 <= metrics[METRIC] <= 1.0 and "eval_logratio_margin" in metrics
        # What the search ranked the trial on is what its run logged at the last step Tune heard of.
        logged = {m.step: m.value for m in registry.client().get_metric_history(run.info.run_id, METRIC)}
        assert trials[trial_id]["metric"] == pytest.approx(logged[trials[trial_id]["step"]])
    assert len(betas) == 2  # each trial trained with its own sampled beta


def test_the_best_trial_registers_like_a_dpo_run(search):
    result, children = search["result"], search["children"]
    finished = [t for t in result["trials"] if t["finished"]]
    best = result["best"]
    assert best["metric"] == max(t["metric"] for t in finished)
    mv = registry.client().get_model_version(result["model_name"], result["model_version"])
    tags = mv.tags
    assert tags[registry.TAG_STAGE] == "dpo"
    assert tags[dpo_stage.TAG_DPO_BETA] == str(best["sampled"]["dpo.beta"])
    assert tags[dpo_stage.TAG_REFERENCE_MODEL] == search["model"]
    assert tags[dpo_stage.TAG_PREFERENCE_VERSION] == tags[registry.TAG_DATASET_VERSION]
    assert tags[dpo_stage.TAG_PREFERENCE_VERSION] == search["parent"].data.tags[dpo_stage.TAG_PREFERENCE_VERSION]
    assert tags[TAG_TUNE_SEARCH] == search["cfg"]["search_name"] and tags[TAG_TUNE_TRIAL] == best["trial_id"]
    assert tags[TAG_TUNE_METRIC].startswith(f"{METRIC}=")
    # The whole search's usage (every trial, the stopped ones too) on the registered best.
    assert tags["rayline.usage.tune_cpu_s"] == f"{result['usage']['cpu_s']:.1f}"
    assert result["usage"]["cpu_s"] > result["usage"]["driver_cpu_s"] and result["usage"]["processes"] >= 4
    assert tags[registry.TAG_WEIGHTS_DIGEST] and mv.run_id == children[best["trial_id"]].info.run_id
