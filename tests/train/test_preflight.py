"""Bad configs fail on the driver before any training worker starts, naming the field at fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core import registry, storage
from core.config import ConfigError
from train.preflight import plan_run

ROOT = Path(__file__).resolve().parents[2]


def test_plan_of_the_test_config(make_train_config):
    plan = plan_run(make_train_config(), {"CPU": 2.0})
    # Ray splits rows evenly over the 2 workers; micro-batch 8; max_steps 12.
    assert plan.steps_per_epoch == plan.train_rows // 2 // 8 and plan.total_steps == 12
    assert plan.resources_per_worker == {"CPU": 0.5}
    assert plan.loop.checkpoint_every_steps == 3 and plan.loop.eval_every_steps == 4
    assert plan.export_uri.endswith("/export") and Path(plan.model_uri).is_absolute()


def test_an_elastic_plan_keeps_one_global_batch_for_every_size(make_train_config):
    plan = plan_run(make_train_config("scaling.num_workers=[1, 2]"), {"CPU": 2.0})
    # Every worker reads the whole split: an epoch is its whole global batches of 8 x 1 x 2 rows.
    assert plan.loop.global_batch_rows == 16 and plan.steps_per_epoch == plan.train_rows // 16
    assert plan.resources_per_worker == {"CPU": 0.5}  # sized for the largest group
    assert plan_run(make_train_config(), {"CPU": 2.0}).loop.global_batch_rows == 0  # a fixed-size run
    with pytest.raises(ConfigError, match=r"train\.grad_accum_steps: the global batch of micro_batch_size 8 x "
                                          r"grad_accum_steps 1 x 3 workers = 24 rows does not split into micro-batches "
                                          r"over 2 workers, a size scaling\.num_workers \[2, 3\] allows"):
        plan_run(make_train_config("scaling.num_workers=[2, 3]"), {"CPU": 64.0})
    # The smallest group must fit; the largest need not yet.
    big = make_train_config("scaling.num_workers=[1, 4]", "train.grad_accum_steps=3", "scaling.resources_per_worker={CPU: 1}")
    assert plan_run(big, {"CPU": 2.0}).loop.global_batch_rows == 8 * 3 * 4  # 1, 2, 3 or 4 workers: 12, 6, 4 or 3 each


def test_an_elastic_checkpoint_resumes_elastic_only(make_train_config, tmp_path):
    from dataclasses import asdict

    from train.checkpoint import TrainerState, mark_committed

    ckpt = tmp_path / "elastic" / "checkpoint_step000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(asdict(TrainerState(step=3, world_size=1,
                                                                            global_batch_rows=16))))
    mark_committed(str(ckpt), 3, world_size=1)
    again = make_train_config("scaling.num_workers=[1, 2]", storage=str(tmp_path), run_name="elastic")
    assert plan_run(again, {"CPU": 2.0}).loop.global_batch_rows == 16
    fixed = make_train_config(storage=str(tmp_path), run_name="elastic")
    with pytest.raises(ConfigError, match=r"scaling\.num_workers: run elastic resumes from .*checkpoint_step000003: "
                                          r"this checkpoint was written by an elastic run"):
        plan_run(fixed, {"CPU": 2.0})


@pytest.mark.parametrize("override, message", [
    ("train.micro_batch_size=100", r"train\.micro_batch_size: one step takes micro_batch_size 100 x grad_accum_steps 1 "
                                   r"x num_workers 2 = 200 rows, but the train split of .* has \d+ rows"),
    ("train.grad_accum_steps=9", r"train\.micro_batch_size: one step takes micro_batch_size 8 x grad_accum_steps 9"),
    ("data.manifest_uri=/nonexistent/prepared", r"data\.manifest_uri: .*no manifest"),
    ("model.path=/nonexistent/model", r"model\.path: /nonexistent/model: no Hugging Face model there"),
    ("model.path=models:/rayline-no-such-model@champion", r"model\.path: models:/rayline-no-such-model@champion: not found"),
    ("scaling.resources_per_worker.CPU=40", r"scaling\.resources_per_worker: \{'CPU': 40.0\} per worker does not fit on "
                                            r"this cluster: 1 run\(s\) x \(2 workers x 40 CPU\) = 80 CPU needed; cluster "
                                            r"has 64 CPU - 1 kept for Ray Data ingest"),
    ("scaling.data_cpus=64", r"scaling\.data_cpus: the cluster has 64 CPU and data_cpus keeps 64 for Ray Data, leaving none"),
    ("scaling.num_workers=30 train.micro_batch_size=1",
     r"data\.manifest_uri: the eval split of .* has \d+ rows, fewer than scaling\.num_workers 30"),
])
def test_bad_config_is_named(make_train_config, override, message):
    with pytest.raises(ConfigError, match=message):
        plan_run(make_train_config(*override.split()), {"CPU": 64.0})


def test_resume_with_another_worker_count_is_refused(make_train_config, tmp_path):
    from dataclasses import asdict

    from train.checkpoint import TrainerState, mark_committed

    ckpt = tmp_path / "resumed" / "checkpoint_step000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(asdict(TrainerState(step=3, world_size=2))))
    mark_committed(str(ckpt), 3)  # as rank 0 does once every rank's files landed: an uncommitted one is not resumed
    assert plan_run(make_train_config(storage=str(tmp_path), run_name="resumed"), {"CPU": 2.0}).total_steps == 12
    one = make_train_config("scaling.num_workers=1", storage=str(tmp_path), run_name="resumed")
    with pytest.raises(ConfigError) as refused:
        plan_run(one, {"CPU": 2.0})
    assert str(refused.value) == (f"scaling.num_workers: run resumed resumes from {ckpt}: this checkpoint was written "
                                  "by 2 workers but the run now has 1; resume it with scaling.num_workers=2, or start "
                                  "a new run_name")


def test_cli_fails_before_any_worker_starts(make_train_config, run_stage):
    cfg = make_train_config("train.micro_batch_size=100")
    run = run_stage("train", cfg)
    assert run.returncode == 2, str(run)
    assert "config error: train.micro_batch_size: one step takes micro_batch_size 100" in run.stderr
    # Ray Train creates the run directory when its controller starts; MLflow gets a run only after the checks.
    assert not storage.exists(storage.join(cfg.checkpoint.storage_path, cfg.run_name))
    assert registry.find_run(cfg.mlflow.experiment, cfg.run_name) is None
    assert "TrainController" not in run.stdout + run.stderr


def test_cli_names_an_unknown_field(local_stack):
    proc = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs/train/tiny.yaml"),
                           "optim.lrr=0.1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "optim.lrr: unknown field (known fields of OptimConfig:" in proc.stderr
