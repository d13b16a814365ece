"""A tune search over a DPO config, checked before anything starts: the shipped YAML validates, a space over dpo.beta
and the shared sections is accepted, bad input is named (the field, the base, what to do), and a trial's config,
objective and tags carry its own sampled values. Nothing here starts Ray or a server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, load_config
from posttrain.dpo_config import DpoConfig
from posttrain.dpo_stage import TAG_DPO_BETA, TAG_PREFERENCE_VERSION, TAG_REFERENCE_MODEL, ScoredVersion
from posttrain.tune_config import PostTrainTuneConfig
from tests.posttrain.searches import yaml_variant

ROOT = Path(__file__).resolve().parents[2]
DPO_TUNE = ROOT / "configs/tune/dpo_tiny.yaml"


def write(tmp_path, **changes) -> Path:
    return yaml_variant(DPO_TUNE, tmp_path, **changes)


def test_shipped_dpo_search_validates_over_beta_and_the_learning_rate():
    cfg = load_config(PostTrainTuneConfig, DPO_TUNE)
    assert set(cfg.space) == {"dpo.beta", "optim.lr"}
    assert (cfg.metric, cfg.mode) == ("eval_preference_accuracy", "max")
    base = cfg.base_config()
    assert isinstance(base, DpoConfig) and base.train.eval_every_steps == 4 == base.train.checkpoint_every_steps
    assert cfg.base_train_config().scaling.num_workers == base.scaling.num_workers


def test_a_space_over_dpo_fields_and_shared_sections_is_accepted(tmp_path):
    space = {"dpo.beta": {"type": "choice", "values": [0.05, 0.5]}, "lora.rank": {"type": "choice", "values": [4, 8]},
             "dpo.shuffle_buffer_rows": {"type": "randint", "low": 0, "high": 64},
             "optim.warmup_steps": {"type": "randint", "low": 0, "high": 3}}
    cfg = load_config(PostTrainTuneConfig, write(tmp_path, space=space,
                                                 post_train_overrides=["train.eval_every_steps=4", "train.checkpoint_every_steps=4",
                                                                       "lora.enabled=true"]))
    assert set(cfg.space) == set(space)


@pytest.mark.parametrize("changes, message", [
    ({"space": {"dpo.betta": {"type": "uniform", "low": 0.1, "high": 0.2}}},
     r"space\.dpo\.betta: no such field in DpoConfig \(.*dpo_tiny\.yaml\)"),
    ({"space": {"dpo.beta": {"type": "uniform", "low": 0.1, "high": 200.0}}},
     r"space\.dpo\.beta: value 200.0 makes an invalid DPO config: .*dpo\.beta: 200.0 must be in \(0, 100\]"),
    ({"space": {"preferences.seq_len": {"type": "choice", "values": [32, 64]}}},
     r"space\.preferences\.seq_len: the preference version and the reference's log-probs are computed once"),
    ({"space": {"dpo.reference": {"type": "choice", "values": ["a", "b"]}}}, r"space\.dpo\.reference: .*computed once"),
    ({"space": {"checkpoint.storage_path": {"type": "choice", "values": ["x"]}}}, r"space\.checkpoint\.storage_path: run names"),
    ({"train_config": "configs/train/tiny.yaml"},
     r"post_train_config: a search starts from one config: train_config \(configs/train/tiny\.yaml\) or "
     r"post_train_config \(configs/post_train/dpo_tiny\.yaml\), not both"),
    ({"post_train_config": ""}, r"train_config: name the config every trial starts from: train_config .* or post_train_config"),
    ({"train_overrides": ["optim.lr=1e-3"]}, r"train_overrides: applies to train_config; overrides of post_train_config go in "
                                             r"post_train_overrides"),
    ({"post_train_overrides": ["dpo.betta=1"]}, r"post_train_config: .*dpo\.betta: unknown field"),
    ({"post_train_config": "configs/post_train/missing.yaml"}, r"post_train_config: .*missing\.yaml: config file not found"),
    ({"metric": "eval_loss", "mode": "min"},
     r"metric: eval_loss is the DPO loss at each trial's own beta, not comparable across the betas `space` samples: "
     r"rank on eval_preference_accuracy or eval_logratio_margin"),
    ({"mode": "min"}, r"mode: eval_preference_accuracy is better higher: set mode: max"),
    ({"metric": "eval_accuracy"}, r"metric: 'eval_accuracy' is not a metric the trials report \(known: eval_loss, loss, "
                                  r"eval_preference_accuracy, eval_logratio_margin\)"),
    ({"post_train_overrides": ["train.eval_every_steps=0"]},
     r"post_train_overrides: eval_preference_accuracy is compared at every checkpoint.*eval_every_steps \(0\) must be set"),
])
def test_bad_dpo_search_fields_are_named(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PostTrainTuneConfig, write(tmp_path, **changes))


def test_eval_loss_ranks_a_search_that_keeps_beta_fixed(tmp_path):
    """Without beta in the space every trial's loss is at the same beta: eval_loss is comparable and accepted."""
    cfg = load_config(PostTrainTuneConfig, write(tmp_path, metric="eval_loss", mode="min",
                                                 space={"optim.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-3}}))
    assert cfg.metric == "eval_loss"


def test_the_dpo_metrics_are_refused_for_a_train_base(tmp_path):
    path = tmp_path / "tune.yaml"
    data = yaml.safe_load((ROOT / "configs/tune/tiny.yaml").read_text())
    path.write_text(yaml.safe_dump({**data, "metric": "eval_preference_accuracy", "mode": "max"}))
    with pytest.raises(ConfigError, match=r"metric: 'eval_preference_accuracy' is not a metric the trials report "
                                          r"\(known: eval_loss, loss\)"):
        load_config(PostTrainTuneConfig, path)


def test_each_dpo_trial_trains_its_own_beta_over_the_one_scored_version():
    from posttrain.dpo_loss import DpoObjective
    from posttrain.dpo_tune import DpoTrials

    cfg = load_config(PostTrainTuneConfig, DPO_TUNE)
    scored = ScoredVersion("pv-1", "/data/prefs/pv-1/reference/abc/manifest.json", "models:/m/3", "sha256:abc",
                           {"batch_run": "r1"})
    trials = DpoTrials(cfg.base_config(), scored)
    sampled = {"dpo.beta": 0.25, "optim.lr": 2e-3}
    tcfg = trials.train_config(sampled, "search-x_00001", "/tmp/runs/search-x", "rayline-tune", {"CPU": 0.5})
    assert tcfg.data.manifest_uri == scored.scored_manifest_uri and tcfg.optim.lr == 2e-3
    assert tcfg.run_name == "search-x_00001" and tcfg.mlflow.register_as == "" and tcfg.mlflow.experiment == "rayline-tune"
    assert tcfg.checkpoint.storage_path == "/tmp/runs/search-x" and tcfg.scaling.resources_per_worker == {"CPU": 0.5}
    assert trials.objective(sampled) == DpoObjective(0.25)
    assert trials.objective({"dpo.beta": 0.05, "optim.lr": 1e-3}) == DpoObjective(0.05)
    assert trials.trial_tags(sampled) == {TAG_DPO_BETA: "0.25"}
    lineage = trials.lineage_tags()
    assert lineage[TAG_PREFERENCE_VERSION] == "pv-1" and lineage[TAG_REFERENCE_MODEL] == "models:/m/3"
    assert lineage["rayline.preference_batch_run"] == "r1" and TAG_DPO_BETA not in lineage
    assert trials.stage == "dpo"

