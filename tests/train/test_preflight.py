"""Bad configs fail on the driver before any training worker starts, naming the field at fault."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import registry, storage
from pipelines.config import ConfigError
from train.trainer import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override, message", [
    ("train.micro_batch_size=100", r"train\.micro_batch_size: one step takes micro_batch_size 100 x grad_accum_steps 1 "
                                   r"x num_workers 2 = 200 rows, but the train split of .* has 128 rows"),
    ("train.grad_accum_steps=9", r"train\.micro_batch_size: one step takes micro_batch_size 8 x grad_accum_steps 9"),
    ("data.manifest_uri=/nonexistent/prepared", r"data\.manifest_uri: .*no manifest"),
    ("model.path=/nonexistent/model", r"model\.path: /nonexistent/model: no Hugging Face model there"),
    ("model.path=models:/rayline-no-such-model@champion", r"model\.path: models:/rayline-no-such-model@champion: not found"),
    ("scaling.resources_per_worker.CPU=1000", r"scaling\.resources_per_worker: \{'CPU': 1000.0\} per worker does not "
                                              r"fit.*1 run\(s\) x \(2 workers x 1000 CPU\) = 2000 CPU needed"),
    ("scaling.data_cpus=1000", r"scaling\.data_cpus: the cluster has \d+ CPU and data_cpus keeps 1000"),
])
def test_bad_config_fails_before_workers_start(make_train_config, override, message):
    cfg = make_train_config(override)
    with pytest.raises(ConfigError, match=message):
        main(cfg)
    # Ray Train creates the run directory when its controller starts; MLflow gets a run only after the checks.
    assert not storage.exists(storage.join(cfg.checkpoint.storage_path, cfg.run_name))
    assert registry.find_run(cfg.mlflow.experiment, cfg.run_name) is None


def test_cli_names_an_unknown_field_and_exits(local_stack):
    proc = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs/train/tiny.yaml"),
                           "optim.lrr=0.1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "optim.lrr: unknown field (known fields of OptimConfig:" in proc.stderr
