"""The tune stage on the test stack (`python -m pipelines.tune` in a subprocess): searches that cannot fit are
refused with the arithmetic; the search summary closes the runs of stopped trials. The ASHA search itself (trials as child runs, the best registered) runs as a Ray
job in the end-to-end test, tests/pipelines/test_demo.py, which asserts the same facts."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import yaml

from pipelines import registry
from pipelines.config import load_config
from train.tune_config import TuneConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


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


def test_trials_asha_stopped_close_killed_and_failed_trials_stay_failed(local_stack, make_tune_config):
    """The search summary closes the child run of every trial ASHA stopped, however the stop reached it
    (the run left RUNNING, or closed FAILED by the exception that ended the trial function); a trial that
    failed (Tune reports its error) keeps FAILED, a finished one FINISHED. Real MLflow runs; the results
    stand in for Tune's, of which the summary reads metrics, config and error."""
    from types import SimpleNamespace

    from train.tune import TAG_TUNE_PARENT, TAG_TUNE_TRIAL, _summaries

    cfg = make_tune_config()
    client = registry.client()
    exp = client.get_experiment_by_name(cfg.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.experiment)
    parent = client.create_run(exp_id, run_name=cfg.search_name).info.run_id
    ends = {"t-running": None, "t-stopped-failed": "FAILED", "t-error": "FAILED", "t-done": "FINISHED"}
    runs = {}
    for trial, end in ends.items():
        runs[trial] = client.create_run(exp_id, tags={TAG_TUNE_PARENT: parent, TAG_TUNE_TRIAL: trial}).info.run_id
        if end:
            client.set_terminated(runs[trial], end)

    def result(trial, step, error=None, export=None):
        metrics = {"trial_id": trial, "step": step, cfg.metric: 1.0, **({"export_uri": export} if export else {})}
        return SimpleNamespace(metrics=metrics, config={k: 0.1 for k in cfg.space}, error=error)

    results = [result("t-running", 2), result("t-stopped-failed", 2), result("t-error", 2, RuntimeError("oom")),
               result("t-done", 6, export="/x")]
    summaries = {s.trial_id: s for s in _summaries(cfg, results, parent, total_steps=6)}
    status = {t: client.get_run(r).info.status for t, r in runs.items()}
    assert status == {"t-running": "KILLED", "t-stopped-failed": "KILLED", "t-error": "FAILED", "t-done": "FINISHED"}
    assert summaries["t-done"].finished and not summaries["t-running"].finished
    assert client.get_run(runs["t-stopped-failed"]).data.tags["rayline.tune_stopped_at_step"] == "2"
