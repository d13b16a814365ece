"""Helpers of the post-training search tests: a shipped tune YAML with changes, and a search run as a user runs it."""

from __future__ import annotations

from pathlib import Path

import yaml

from core import registry
from tests.posttrain.test_dpo_stage import _run
from train.tune import TAG_TUNE_PARENT, TAG_TUNE_TRIAL


def yaml_variant(base: Path, tmp_path: Path, **changes) -> Path:
    """`base` (a YAML mapping) with the top-level `changes`, written to `tmp_path`/tune.yaml."""
    data = yaml.safe_load(base.read_text())
    data.update(changes)
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_search(cfg: dict, tmp: Path) -> dict:
    """`python -m pipelines.tune` over the tune config `cfg` as the trainer role; its result, stdout, the search's
    MLflow run and the trials' child runs by trial id."""
    path = tmp / "tune.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result, stdout = _run("pipelines.tune", ["--config", str(path)], "trainer")
    client = registry.client()
    parent = client.get_run(result["parent_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`{TAG_TUNE_PARENT}` = '{result['parent_run_id']}'")
    return {"cfg": cfg, "result": result, "stdout": stdout, "parent": parent,
            "children": {r.data.tags[TAG_TUNE_TRIAL]: r for r in children}}
