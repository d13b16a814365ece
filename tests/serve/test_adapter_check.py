"""The gate's adapter checks (serve/adapter_check.py) on real PEFT adapters of the tiny model: a good one passes,
and each way an adapter can fail to fit its base or the engine is named before any engine sees it."""

from __future__ import annotations

import json
import shutil

import pytest

from serve.adapter_check import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_problems, is_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A rank-4 PEFT adapter of the tiny model on q_proj and v_proj, written by peft itself."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return out


@pytest.fixture
def copy_of(adapter_dir, tmp_path):
    def copy():
        return shutil.copytree(adapter_dir, tmp_path / "adapter")
    return copy


def test_a_good_adapter_passes_and_is_told_from_a_full_model(adapter_dir, tiny_model_dir):
    assert adapter_problems(str(adapter_dir), str(tiny_model_dir), max_lora_rank=8) == []
    assert is_adapter(str(adapter_dir)) and not is_adapter(str(tiny_model_dir))


def test_missing_weights_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    (broken / ADAPTER_WEIGHTS).unlink()
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [f"{broken}: {ADAPTER_WEIGHTS} is missing"]


def test_a_rank_above_the_engines_max_lora_rank_is_refused(adapter_dir, tiny_model_dir):
    problems = adapter_problems(str(adapter_dir), str(tiny_model_dir), max_lora_rank=1)
    assert problems == [f"{adapter_dir}/{ADAPTER_CONFIG}: r=4 exceeds the serving max_lora_rank 1"]


def test_target_modules_the_base_lacks_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    config = json.loads((broken / ADAPTER_CONFIG).read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (broken / ADAPTER_CONFIG).write_text(json.dumps(config))
    problems = adapter_problems(str(broken), str(tiny_model_dir), 8)
    assert len(problems) == 1 and "target_modules ['c_attn'] are not linear layers of the base" in problems[0]
    assert "'q_proj'" in problems[0]  # what the base has


def test_an_adapter_of_another_base_is_refused_by_shape(adapter_dir, tiny_model_dir, tmp_path):
    wider = tmp_path / "wider-base"
    wider.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    problems = adapter_problems(str(adapter_dir), str(wider), 8)
    # q_proj's and v_proj's lora_A take hidden_size inputs (their outputs are heads x head_dim, unchanged).
    layers = config["num_hidden_layers"]
    assert len(problems) == 2 * layers, problems
    first = f"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, {config['hidden_size']}]"
    assert any(first in p and f"needs [4, {2 * config['hidden_size']}]" in p for p in problems), problems


def test_a_cut_short_weights_file_and_a_bad_config_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    data = (broken / ADAPTER_WEIGHTS).read_bytes()
    (broken / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    problems = adapter_problems(str(broken), str(tiny_model_dir), 8)
    assert len(problems) == 1 and "cut short" in problems[0], problems
    (broken / ADAPTER_CONFIG).write_text('{"r": 0}')
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_CONFIG}: r=0 is not a positive integer"]


def test_weights_on_layers_the_base_lacks_are_named(copy_of, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    broken = copy_of()
    weights = load_file(broken / ADAPTER_WEIGHTS)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    weights[key.replace("layers.0", "layers.9")] = weights[key].clone()
    save_file(weights, broken / ADAPTER_WEIGHTS)
    problems = adapter_problems(str(broken), str(tiny_model_dir), 8)
    assert problems == [f"{broken}/{ADAPTER_WEIGHTS}: {key.replace('layers.0', 'layers.9')} sits on "
                        f"model.layers.9.self_attn.q_proj, which the base {tiny_model_dir} does not have"]
