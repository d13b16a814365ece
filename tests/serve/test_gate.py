"""The rollout gate on tiny inputs: eval tags against thresholds, checkpoints checked file by file."""

from __future__ import annotations

import json
import shutil

import pytest

from serve.promotion.gate import checkpoint_problems, gate_problems, metric_problems
from serve.promotion.rollout_config import GateConfig


def test_metrics_pass_fail_missing_and_not_a_number():
    gate = GateConfig(min_metrics={"eval.exact_match": 0.5}, max_metrics={"eval.error_rate": 0.1})
    assert metric_problems({"eval.exact_match": "0.5", "eval.error_rate": "0.1"}, gate) == []
    (low,) = metric_problems({"eval.exact_match": "0.25", "eval.error_rate": "0"}, gate)
    assert low == "eval.exact_match=0.25 < 0.5 (gate.min_metrics)"
    (high,) = metric_problems({"eval.exact_match": "1", "eval.error_rate": "0.3"}, gate)
    assert high == "eval.error_rate=0.3 > 0.1 (gate.max_metrics)"
    missing, nan = metric_problems({"eval.error_rate": "nan"}, gate)
    assert "eval.exact_match is missing" in missing and "nan" in nan


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    return tiny_model_dir


def test_a_whole_checkpoint_passes(checkpoint):
    assert checkpoint_problems(str(checkpoint)) == []


def test_truncated_weights_are_caught(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    (problem,) = checkpoint_problems(str(ckpt))
    assert "model.safetensors" in problem and "cut short" in problem


def test_weights_of_another_shape_than_config_json(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    (problem,) = checkpoint_problems(str(ckpt))
    assert "embed_tokens.weight" in problem and "do not match" in problem


def test_missing_files_are_each_named(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "model.safetensors").unlink()
    (ckpt / "config.json").write_text("{not json")
    problems = " | ".join(checkpoint_problems(str(ckpt)))
    assert "config.json: not valid JSON" in problems and "no tokenizer" in problems and "no weight files" in problems


def test_sharded_checkpoint_needs_every_shard(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(ckpt / "model.safetensors", ckpt / "model-00001-of-00002.safetensors")
    (problem,) = checkpoint_problems(str(ckpt))
    assert "shard model-00002-of-00002.safetensors" in problem


def test_empty_or_absent_checkpoint(tmp_path):
    assert "no files" in checkpoint_problems(str(tmp_path / "nowhere"))[0]


def test_gate_reports_metrics_then_artifacts(checkpoint, tmp_path):
    gate = GateConfig(min_metrics={"eval.exact_match": 0.9})
    # No digest, no evidence: tags never count, so the figures are missing whatever the version is tagged with.
    problems = gate_problems("m", "1", None, str(tmp_path / "gone"), gate)
    assert len(problems) == 2 and problems[0].startswith("no finished eval run of m/1") and "no files" in problems[1]
    assert gate_problems("m", "1", None, None, GateConfig(min_metrics={})) == []


def test_pickled_weights_are_refused(checkpoint, tmp_path):
    import shutil

    ckpt = tmp_path / "pickled"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"not loaded: refused by name")
    (problem,) = checkpoint_problems(str(ckpt))
    assert problem.endswith("pytorch_model.bin: pickle-based weights are refused (loading one can run code); "
                            "export safetensors")
