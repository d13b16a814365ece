"""A tune search over a GRPO config, checked before anything starts: the shipped YAML validates as a GRPO search, bad
input is named (the field, the base, what to do), the capacity arithmetic refuses what cannot fit, and a trial's config
carries its sampled values and its own run, output and no registration. Nothing here starts Ray or a server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, load_config
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo_tune import absolute_paths, max_concurrent_trials, trial_config
from posttrain.tune_config import PostTrainTuneConfig
from tests.posttrain.searches import yaml_variant

ROOT = Path(__file__).resolve().parents[2]
GRPO_TUNE = ROOT / "configs/tune/grpo_tiny.yaml"


def write(tmp_path, **changes) -> Path:
    return yaml_variant(GRPO_TUNE, tmp_path, **changes)


def test_shipped_grpo_search_validates_over_the_learning_rate_and_group_size():
    cfg = load_config(PostTrainTuneConfig, GRPO_TUNE)
    assert cfg.post_train_stage() == "grpo"
    assert set(cfg.space) == {"policy.lr", "group_size"}
    assert (cfg.metric, cfg.mode) == ("reward_mean", "max")
    base = cfg.base_config()
    assert isinstance(base, GrpoConfig) and base.steps == 12 and base.checkpoint_every == 0


@pytest.mark.parametrize("changes, message", [
    ({"space": {"policy.lrr": {"type": "uniform", "low": 0.1, "high": 0.2}}},
     r"space\.policy\.lrr: no such field in GrpoConfig \(.*grpo_tiny\.yaml\)"),
    ({"space": {"group_size": {"type": "choice", "values": [1, 4]}}},
     r"space\.group_size: value 1 makes an invalid GRPO config: .*group_size: must be at least 2"),
    ({"space": {"model": {"type": "choice", "values": ["a", "b"]}}}, r"space\.model: every trial starts from the same"),
    ({"space": {"prompts.limit": {"type": "choice", "values": [8]}}}, r"space\.prompts\.limit: every trial starts"),
    ({"space": {"output_uri": {"type": "choice", "values": ["x"]}}}, r"space\.output_uri: run names"),
    ({"metric": "eval_loss", "mode": "min"}, r"metric: 'eval_loss' is not a metric the trials report \(known: reward_mean\)"),
    ({"mode": "min"}, r"mode: reward_mean is better higher: set mode: max"),
    ({"asha": {"grace_period": 12}}, r"asha\.grace_period: 12 steps leaves no rung before the end of a 12-step GRPO trial"),
    ({"post_train_overrides": ["group_size=1"]}, r"post_train_config: .*group_size: must be at least 2"),
])
def test_bad_grpo_searches_are_named(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PostTrainTuneConfig, write(tmp_path, **changes))


def test_a_post_train_config_that_is_neither_dpo_nor_grpo_is_named(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"model": "x", "steps": 3}))
    with pytest.raises(ConfigError, match=r"post_train_config: .*other\.yaml is neither a DPO config .* nor a GRPO"):
        load_config(PostTrainTuneConfig, write(tmp_path, post_train_config=str(other)))


def test_trials_that_do_not_fit_are_refused_with_the_arithmetic(tmp_path):
    cfg = load_config(PostTrainTuneConfig, GRPO_TUNE)
    base = cfg.base_config()  # 1 engine x 0.8 + 1 rank x 0.8 + the trial driver's 0.01 CPU
    assert max_concurrent_trials(cfg, base, {"CPU": 2.0})[0] == 1
    assert max_concurrent_trials(cfg, base, {"CPU": 8.0})[0] == 3  # num_samples caps it
    with pytest.raises(ConfigError, match=r"not even one GRPO trial fits.*1 CPUs / \(1 engine\(s\) x 0\.8 \+ "
                                          r"1 rank\(s\) x 0\.8 \+ trial driver 0\.01 = 1\.61 a trial\) = 0"):
        max_concurrent_trials(cfg, base, {"CPU": 1.0})
    two = load_config(PostTrainTuneConfig, write(tmp_path, max_concurrent_trials=2))
    with pytest.raises(ConfigError, match=r"max_concurrent_trials: 2 concurrent trials do not fit"):
        max_concurrent_trials(two, base, {"CPU": 2.0})


def test_a_trial_runs_its_sampled_values_under_its_own_name_and_registers_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(PostTrainTuneConfig, GRPO_TUNE)
    base = absolute_paths(cfg.base_config())
    assert Path(base.output_uri).is_absolute() and Path(base.prompts.uri).is_absolute()
    assert base.model == "models:/rayline-tiny@champion"  # a registry reference stays as it is
    trial = trial_config(base, {"policy.lr": 1e-4, "group_size": 4}, "tiny-grpo-search-abc_00001", cfg.search_name,
                         "rayline-tune")
    assert (trial.policy.lr, trial.group_size) == (1e-4, 4)
    assert (trial.run_name, trial.register_as, trial.mlflow_experiment) == (
        "tiny-grpo-search-abc_00001", "", "rayline-tune")
    assert trial.output_uri == str(Path(base.output_uri) / cfg.search_name)
    assert (trial.steps, trial.model, trial.prompts) == (base.steps, base.model, base.prompts)
