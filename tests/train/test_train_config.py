"""TrainConfig / TuneConfig: the shipped YAMLs validate, and bad input fails naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, load_config
from train.config import TrainConfig
from train.tune_config import TuneConfig, trial_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/train/tiny.yaml"


@pytest.mark.parametrize("name", ["tiny.yaml", "small_gpu.yaml"])
def test_shipped_train_configs_validate(name):
    cfg = load_config(TrainConfig, ROOT / "configs/train" / name)
    assert cfg.scaling.num_workers >= 2


def test_gpu_config_is_bf16_on_8_gpus():
    cfg = load_config(TrainConfig, ROOT / "configs/train/small_gpu.yaml")
    assert cfg.bf16 and cfg.scaling.num_workers == 8
    assert cfg.scaling.worker_resources(cluster_cpus=64) == {"GPU": 1.0, "CPU": 6.0}


def test_cpu_workers_share_what_data_ingest_leaves():
    cfg = load_config(TrainConfig, TINY)
    assert not cfg.bf16
    assert cfg.scaling.worker_resources(cluster_cpus=2) == {"CPU": 0.5}
    assert cfg.scaling.worker_resources(cluster_cpus=16) == {"CPU": 1.0}
    assert cfg.scaling.worker_resources(cluster_cpus=2, reserved_cpus=0.01) == {"CPU": 0.49}


@pytest.mark.parametrize("override, field", [
    ("optim.lrr=0.1", "optim.lrr: unknown field"),
    ("optim.lr=2", "optim.lr: 2.0 is not a learning rate"),
    ("train.micro_batch_size=0", "train.micro_batch_size: must be >= 1"),
    ("train.precision=bf16", "train.precision: bf16 needs GPUs"),
    ("run_name=a/b", "run_name: 'a/b' must be"),
    ("scaling.resources_per_worker.GPU=1", "scaling.resources_per_worker.GPU: asks for GPUs"),
    ("data.materialize=[test]", "data.materialize[0]: 'test' is not a split"),
    ("checkpoint.num_to_keep=0", "checkpoint.num_to_keep: must be >= 1"),
    ("checkpoint.notice_grace_s=0", "checkpoint.notice_grace_s: must be > 0 seconds"),
    ("checkpoint.save_estimate_s=-1", "checkpoint.save_estimate_s: must be >= 0 seconds"),
    ("scaling.node_labels={rayline.io/node: 'in(worker-1'}", "scaling.node_labels.rayline.io/node: Invalid label selector"),
    ("scaling.num_workers=[2, 1]", "scaling.num_workers: [2, 1]: an elastic size needs 1 <= min <= max"),
    ("scaling.num_workers=[0, 2]", "scaling.num_workers: [0, 2]: an elastic size needs 1 <= min <= max"),
    ("scaling.num_workers=[1, 2, 4]", "scaling.num_workers: [1, 2, 4]: an elastic size is [min, max], two numbers"),
    ("scaling.resize_check_s=0", "scaling.resize_check_s: must be > 0 seconds"),
])
def test_bad_train_fields_are_named(override, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")):
        load_config(TrainConfig, TINY, [override])


def test_an_elastic_size_is_a_range_shared_by_its_largest_group():
    cfg = load_config(TrainConfig, TINY, ["scaling.num_workers=[1, 2]", "scaling.resize_check_s=5"])
    assert cfg.scaling.elastic and cfg.scaling.num_workers == (1, 2)
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 2)
    assert cfg.scaling.worker_resources(cluster_cpus=2) == {"CPU": 0.5}  # what 2 workers can have beside ingest
    fixed = load_config(TrainConfig, TINY)
    assert not fixed.scaling.elastic and (fixed.scaling.min_workers, fixed.scaling.max_workers) == (2, 2)


def test_an_elastic_run_cannot_be_pinned_by_node_labels():
    """Ray Train sizes an elastic group by the resources that fit, labels aside: pinned by labels, a run could wait
    forever for a size that the labels forbid."""
    with pytest.raises(ConfigError, match=r"scaling\.node_labels: cannot pin an elastic run by node labels.*custom "
                                          r"resource"):
        load_config(TrainConfig, TINY, ["scaling.num_workers=[1, 2]", "scaling.node_labels={rayline.io/node: worker-1}"])


def write_tune(tmp_path, **changes) -> Path:
    data = yaml.safe_load((ROOT / "configs/tune/tiny.yaml").read_text())
    for key, value in changes.items():
        if key == "space":
            data["space"].update(value)
        else:
            data[key] = value
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_tune_config_validates():
    cfg = load_config(TuneConfig, ROOT / "configs/tune/tiny.yaml")
    assert set(cfg.space) == {"optim.lr", "optim.warmup_steps", "optim.weight_decay"}
    assert cfg.base_train_config().train.epochs == 1


@pytest.mark.parametrize("changes, message", [
    ({"space": {"optim.lrr": {"type": "uniform", "low": 0.1, "high": 0.2}}}, "space.optim.lrr: no such field in TrainConfig"),
    ({"space": {"optim.warmup_steps": {"type": "uniform", "low": 0.5, "high": 2}}},
     "space.optim.warmup_steps: value 0.5 makes an invalid train config.*expected an integer"),
    ({"space": {"optim.lr": {"type": "loguniform", "low": 0, "high": 0.1}}}, "space.optim.lr.low: loguniform needs low > 0"),
    ({"space": {"optim.lr": {"type": "uniform", "low": 0.001, "high": 3}}}, "space.optim.lr: value 3"),
    ({"space": {"checkpoint.storage_path": {"type": "choice", "values": ["x"]}}}, "space.checkpoint.storage_path: run names"),
    ({"train_config": "configs/train/missing.yaml"}, "train_config: .*missing.yaml: config file not found"),
    ({"train_overrides": ["optim.lrr=1"]}, "train_config: <overrides>|train_config: .*optim.lrr: unknown field"),
    ({"num_samples": 0}, "num_samples: must be >= 1"),
    ({"train_overrides": ["scaling.num_workers=[1, 2]"]},
     r"train_overrides: scaling.num_workers \[1, 2\] is an elastic size; a search's trials share the cluster at a "
     r"fixed size each"),
    ({"train_overrides": ["train.epochs=1", "train.eval_every_steps=0"]},
     r"train_overrides: eval_loss is compared at every checkpoint.*eval_every_steps \(0\) must be set"),
])
def test_bad_tune_fields_are_named(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TuneConfig, write_tune(tmp_path, **changes))


def test_trial_config_applies_samples_and_isolates_the_trial():
    base = load_config(TrainConfig, TINY)
    cfg = trial_config(base, {"optim.lr": 1e-3, "optim.warmup_steps": 3}, "search-abc_00001", "/tmp/s", "exp",
                       {"CPU": 0.49})
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.run_name) == (1e-3, 3, "search-abc_00001")
    assert cfg.mlflow.register_as == "" and cfg.mlflow.experiment == "exp"
    assert cfg.checkpoint.storage_path == "/tmp/s" and cfg.scaling.resources_per_worker == {"CPU": 0.49}
