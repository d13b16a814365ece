"""Fixtures of the train tests: the sample corpus prepared by the real data stage, and train configs over it.

The integration tests run the real entry points, `python -m pipelines.train` / `pipelines.tune`, in
subprocesses against the test stack (Ray head with 2 CPUs, MLflow, Swift S3), as a user or a RayJob
would; each prints its result as one JSON line (tests/train/stages.py, which bench/bench_faults.py uses too). The
prepared dataset comes from `python -m pipelines.prepare_data`, run once per session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.stages import History, StageRun, prepare_sample_data, start_stage as start_process, train_config


@pytest.fixture(scope="session")
def prepared_manifest(local_stack, sample_corpus_dir, tiny_model_dir, tmp_path_factory) -> str:
    return prepare_sample_data(Path(sample_corpus_dir), tiny_model_dir, tmp_path_factory.mktemp("prepared"))


@pytest.fixture(scope="session")
def start_stage(local_stack, tmp_path_factory):
    """Start `python -m pipelines.<stage> --config <cfg written as YAML>` with extra env; returns a StartedStage."""
    configs = tmp_path_factory.mktemp("configs")

    def start(stage: str, cfg, env: dict[str, str] | None = None):
        return start_process(stage, cfg, configs, env)

    return start


@pytest.fixture(scope="session")
def run_stage(start_stage):
    """Run `python -m pipelines.<stage> --config <cfg written as YAML>` with extra env; returns a StageRun."""

    def run(stage: str, cfg, env: dict[str, str] | None = None, timeout: int = 1500) -> StageRun:
        return start_stage(stage, cfg, env).finish(timeout)

    return run


@pytest.fixture(scope="session")
def make_train_config(prepared_manifest, tiny_model_dir, tmp_path_factory):
    """A TrainConfig from configs/train/tiny.yaml over the test data, with a unique run name."""
    runs = tmp_path_factory.mktemp("runs")

    def make(*overrides: str, storage: str | None = None, run_name: str | None = None):
        return train_config(tiny_model_dir, prepared_manifest, storage or str(runs), *overrides, run_name=run_name)

    return make


@pytest.fixture(scope="session")
def history(local_stack) -> History:
    return History()


@pytest.fixture
def one_process_group():
    """A 1-rank gloo group in this process: FSDP2 and DCP as a Ray Train worker runs them, without Ray."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
