"""The tune stage on the test stack: searches that cannot fit are refused with the arithmetic
(`python -m pipelines.tune` in a subprocess); the search summary closes the runs of trials a real ASHA
search stopped. The search as the demo runs it (train-stage trials as child runs, the best registered) runs as a
Ray job in the end-to-end test, tests/pipelines/test_demo.py, with one trial there to keep the suite's time."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import yaml

from core import registry
from core.config import load_config
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


def test_a_search_that_cannot_fit_is_refused_with_the_arithmetic(make_tune_config, start_stage):
    # Both refusals at once: each is a process that connects to Ray and reads its CPUs before it refuses.
    too_big_cfg = make_tune_config("scaling.resources_per_worker.CPU=1000")
    too_many, too_big = (start_stage("tune", make_tune_config(max_concurrent_trials=50)),
                         start_stage("tune", too_big_cfg))
    run = too_many.finish(300)
    assert run.returncode == 2, str(run)
    assert re.search(r"config error: max_concurrent_trials: 50 concurrent trials do not fit, at most \d+ do: 50 run\(s\) "
                     r"x \(2 workers x [\d.]+ CPU \+ 0\.01 CPU trial driver\) = [\d.]+ CPU needed; cluster has [\d.]+ CPU "
                     r"- 1 kept for Ray Data ingest \(scaling\.data_cpus\) = [\d.]+ CPU usable: does not fit", run.stderr)

    run = too_big.finish(300)
    assert run.returncode == 2, str(run)
    assert re.search(r"not even one trial fits.*1 run\(s\) x \(2 workers x 1000 CPU \+ 0\.01 CPU trial driver\) = "
                     r"2000\.01 CPU needed.*does not fit", run.stderr)
    assert registry.find_run(too_big_cfg.experiment, too_big_cfg.search_name) is None


def test_trials_asha_stopped_close_killed_and_failed_trials_stay_failed(ray_session, tmp_path):
    """The search summary closes the child run of every trial ASHA stopped, however the stop reached it
    (the run left RUNNING by the ended actor, or closed FAILED by the exception that ended the trial
    function); a trial that failed keeps FAILED, a finished one FINISHED.

    A real ASHA search on the test stack's Ray, over trials that each play one ending against a real
    MLflow child run: they report `step` and the metric at 2, 4 and 6 like a 6-step train-stage trial,
    one at a time in grid order, so ASHA (rungs at 2 and 4, as the stage sets them) stops the second
    and third at the first rung. The summary reads Tune's own results.
    """
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from train.tune import TAG_TUNE_PARENT, TAG_TUNE_TRIAL, trial_summaries

    cfg = load_config(TuneConfig, ROOT / "configs/tune/tiny.yaml",
                      [f"search_name=search-{uuid.uuid4().hex[:6]}", "experiment=rayline-test-tune"])
    client = registry.client()
    exp = client.get_experiment_by_name(cfg.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.experiment)
    parent = client.create_run(exp_id, run_name=cfg.search_name).info.run_id
    metric = cfg.metric
    endings = ["finishes", "stopped", "stopped-after-closing-failed", "raises"]
    first_metric = {"finishes": 1.0, "stopped": 5.0, "stopped-after-closing-failed": 6.0, "raises": 0.5}

    def trial(config):  # runs in a Tune trial actor
        import time

        from ray import tune

        from core import registry as trial_registry

        ending = config["ending"]
        client = trial_registry.client()  # logs in as the driver's role, as the train stage's trials do
        tags = {TAG_TUNE_PARENT: parent, TAG_TUNE_TRIAL: tune.get_context().get_trial_id()}
        run_id = client.create_run(exp_id, run_name=f"trial-{ending}", tags=tags).info.run_id
        if ending == "stopped-after-closing-failed":
            # What a stop that reaches the train stage's trial function as an exception leaves behind.
            client.set_terminated(run_id, "FAILED")
        for step in (2, 4, 6):
            final = {"export_uri": "/x"} if step == 6 else {}  # the train stage's last report names its export
            tune.report({"step": step, metric: first_metric[ending] * 2 / step, **final})
            if ending.startswith("stopped"):
                time.sleep(600)  # ASHA stops the trial at step 2; its actor ends long before this does
            if ending == "raises":
                time.sleep(5)  # let Tune take the step-2 result first
                client.set_terminated(run_id, "FAILED")
                raise RuntimeError("worker ran out of memory")
        client.set_terminated(run_id, "FINISHED")

    tuner = tune.Tuner(
        tune.with_resources(trial, {"CPU": 0.01}),
        param_space={"ending": tune.grid_search(endings), **{k: d.to_tune() for k, d in cfg.space.items()}},
        tune_config=tune.TuneConfig(
            metric=metric, mode="min", num_samples=1,
            scheduler=ASHAScheduler(time_attr="step", max_t=5, grace_period=2, reduction_factor=2.0,
                                    stop_last_trials=False),
            search_alg=BasicVariantGenerator(random_state=0, max_concurrent=1),
        ),
        run_config=tune.RunConfig(name="summaries", storage_path=str(tmp_path)),
    )
    results = {r.config["ending"]: r for r in tuner.fit()}
    assert sorted(results) == sorted(endings)
    trial_of = {e: results[e].metrics["trial_id"] for e in endings}
    assert {e: results[e].metrics["step"] for e in endings} == {"finishes": 6, "stopped": 2,
                                                                 "stopped-after-closing-failed": 2, "raises": 2}
    assert [e for e in endings if results[e].error is not None] == ["raises"]
    assert "worker ran out of memory" in str(results["raises"].error)

    def child_runs() -> dict:
        found = client.search_runs([exp_id], f"tags.`{TAG_TUNE_PARENT}` = '{parent}'")
        by_trial = {r.data.tags[TAG_TUNE_TRIAL]: r for r in found}
        return {e: by_trial[trial_of[e]] for e in endings}

    # What the trials left: ASHA's stop ended the second trial before it closed its run.
    before = {e: r.info.status for e, r in child_runs().items()}
    assert before == {"finishes": "FINISHED", "stopped": "RUNNING", "stopped-after-closing-failed": "FAILED",
                      "raises": "FAILED"}

    summaries = {s.trial_id: s for s in trial_summaries(cfg, list(results.values()), parent, total_steps=6)}
    after = child_runs()
    assert {e: r.info.status for e, r in after.items()} == {
        "finishes": "FINISHED", "stopped": "KILLED", "stopped-after-closing-failed": "KILLED", "raises": "FAILED"}
    assert {e: r.data.tags.get("rayline.tune_stopped_at_step") for e, r in after.items()} == {
        "finishes": None, "stopped": "2", "stopped-after-closing-failed": "2", "raises": None}
    assert {e: summaries[trial_of[e]].finished for e in endings} == {
        "finishes": True, "stopped": False, "stopped-after-closing-failed": False, "raises": False}
    for e in endings:
        summary = summaries[trial_of[e]]
        assert summary.mlflow_run_id == after[e].info.run_id and summary.run_name == f"trial-{e}"
        assert summary.sampled == {k: results[e].config[k] for k in cfg.space}
        assert summary.metric == results[e].metrics[metric]
