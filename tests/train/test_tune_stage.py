"""The tune stage on the test stack (`python -m pipelines.tune` in a subprocess): a small ASHA search of child
runs with the best registered, and searches that cannot fit refused with the arithmetic."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import yaml

from pipelines import registry
from pipelines.config import load_config
from train.tune import TAG_TUNE_PARENT, TAG_TUNE_SEARCH, TAG_TUNE_TRIAL
from train.tune_config import TuneConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1800)  # three trials, one at a time on a 2-core machine


@pytest.fixture()
def make_tune_config(prepared_manifest, tiny_model_dir, tmp_path):
    def make(*train_overrides: str, **fields) -> TuneConfig:
        data = yaml.safe_load((ROOT / "configs/tune/tiny.yaml").read_text())
        data["search_name"] = f"search-{uuid.uuid4().hex[:6]}"
        data["experiment"] = "rayline-test-tune"
        data["register_as"] = f"rayline-test-tuned-{uuid.uuid4().hex[:6]}"
        # 6 steps per trial, a report (and ASHA decision) every 2.
        data["train_overrides"] = [
            f"model.path={tiny_model_dir}", f"data.manifest_uri={prepared_manifest}",
            f"checkpoint.storage_path={tmp_path / 'runs'}", "train.micro_batch_size=8", "train.max_steps=6",
            "train.checkpoint_every_steps=2", "train.eval_every_steps=2", "train.eval_batch_size=16",
            *train_overrides,
        ]
        data["asha"] = {"grace_period": 2, "reduction_factor": 2.0, "max_t": 0}
        data.update(fields)
        path = tmp_path / "tune.yaml"
        path.write_text(yaml.safe_dump(data))
        return load_config(TuneConfig, path)

    return make


def test_asha_search_runs_trials_as_child_runs_and_registers_the_best(make_tune_config, run_stage):
    cfg = make_tune_config()
    run = run_stage("tune", cfg)
    assert run.returncode == 0 and run.result, str(run)
    result = run.result

    assert result["max_concurrent_trials"] >= 1 and result["capacity"].endswith("fits")  # one at a time on 2 CPUs
    trials = result["trials"]
    assert len(trials) == cfg.num_samples == 3
    assert len({tuple(sorted(t["sampled"].items())) for t in trials}) == 3
    finished = [t for t in trials if t["finished"]]
    assert finished and all(t["step"] == 6 for t in finished)
    best = result["best"]
    assert best["metric"] == min(t["metric"] for t in finished)

    client = registry.client()
    parent_id = result["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == cfg.search_name and parent.data.tags[TAG_TUNE_SEARCH] == cfg.search_name
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(r.data.tags[TAG_TUNE_TRIAL] for r in children) == sorted(t["trial_id"] for t in trials)
    # Finished trials close their runs; trials ASHA stopped are closed KILLED by the driver.
    status = {r.data.tags[TAG_TUNE_TRIAL]: r.info.status for r in children}
    assert all(status[t["trial_id"]] == ("FINISHED" if t["finished"] else "KILLED") for t in trials), status
    assert all(len(client.get_metric_history(r.info.run_id, "loss")) >= 2 for r in children)

    mv = registry.get_version(f"models:/{result['model_name']}/{result['model_version']}")
    assert (mv.tags[TAG_TUNE_SEARCH], mv.tags[TAG_TUNE_PARENT], mv.tags[TAG_TUNE_TRIAL]) == (
        cfg.search_name, parent_id, best["trial_id"])
    assert mv.run_id == best["mlflow_run_id"]
    assert mv.tags[registry.TAG_CHECKPOINT_URI].endswith(f"{cfg.search_name}/{best['run_name']}/export")
    assert mv.tags[registry.TAG_DATASET_VERSION] and mv.tags[registry.TAG_BASE_MODEL] == cfg.base_train_config().model.path


def test_a_search_that_cannot_fit_is_refused_with_the_arithmetic(make_tune_config, run_stage):
    cfg = make_tune_config(max_concurrent_trials=50)
    run = run_stage("tune", cfg)
    assert run.returncode == 2, str(run)
    assert re.search(r"config error: max_concurrent_trials: 50 concurrent trials do not fit, at most \d+ do: 50 run\(s\) "
                     r"x \(2 workers x [\d.]+ CPU \+ 0\.01 CPU trial driver\) = [\d.]+ CPU needed; cluster has [\d.]+ CPU "
                     r"- 1 kept for Ray Data ingest \(scaling\.data_cpus\) = [\d.]+ CPU usable: does not fit", run.stderr)

    cfg = make_tune_config("scaling.resources_per_worker.CPU=1000")
    run = run_stage("tune", cfg)
    assert run.returncode == 2, str(run)
    assert re.search(r"not even one trial fits.*1 run\(s\) x \(2 workers x 1000 CPU \+ 0\.01 CPU trial driver\) = "
                     r"2000\.01 CPU needed.*does not fit", run.stderr)
    assert registry.find_run(cfg.experiment, cfg.search_name) is None
