"""LoRA on the FSDP2 loop (issue 18, training): peft adapters on a frozen, sharded base; checkpoints and export
hold the adapter only; the export loads in peft and transformers; a run resumes after a lost worker and when
submitted again after its job failed; the version registered is an adapter tagged with the exact base version it was trained on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

from data.prepared import COLUMNS, load_manifest
from core import registry, storage
from core.config import ConfigError, from_dict, load_config
from tests.train.fault_injector import fault_env
from train.checkpoint import TrainerState, load_checkpoint, newest_trainer_state, save_checkpoint
from train.config import LoraConfig, OptimConfig, TrainConfig
from train.export import export_model
from train.fsdp import build_sharded_model
from train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_target_modules
from train.mfu import parameter_count, train_flops_per_token
from train.optimizer import build_optimizer
from train.packed_batch import forward_loss_sum, loss_tokens

ROOT = Path(__file__).resolve().parents[2]
LORA = ["lora.enabled=true", "lora.rank=8", "lora.alpha=32", "optim.lr=2.0e-2"]
TOKENS = 8  # greedy tokens compared per prompt: enough that a trained adapter changes some of them


@pytest.mark.parametrize("field,value,message", [
    ("rank", 0, "lora.rank: must be >= 1, got 0"),
    ("alpha", 0.0, "lora.alpha: must be > 0"),
    ("dropout", 1.0, "lora.dropout: must be within [0, 1)"),
    ("target_modules", [], "lora.target_modules: must name at least one linear layer"),
    ("target_modules", ["q_proj", "layers.0"], "lora.target_modules[1]: 'layers.0' is not a module name"),
])
def test_bad_lora_settings_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(LoraConfig, {"enabled": True, field: value}, "train.yaml")


def test_the_shipped_config_mirrors_the_dataclass_with_lora_off():
    cfg = load_config(TrainConfig, ROOT / "configs/train/tiny.yaml", [])
    assert cfg.lora == LoraConfig() and not cfg.lora.enabled


def test_targets_the_base_lacks_are_refused_from_its_config_alone(tiny_model_dir):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    check_target_modules(config, ["q_proj", "down_proj"])  # the tiny model is a Qwen-style decoder
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['query_key_value'\] is not a linear layer of the "
                                          r"base model; it has \[.*'q_proj'.*\]"):
        check_target_modules(config, ["q_proj", "query_key_value"])


def test_only_the_adapter_trains_is_checkpointed_and_exported(one_process_group, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])

    def fresh():
        model = build_sharded_model(str(tiny_model_dir), torch.device("cpu"), lora=lora, base_model_ref="models:/b/3")
        return model, *build_optimizer(model, OptimConfig(lr=1e-2), 10)

    model, optimizer, scheduler = fresh()
    layers = len(model.get_base_model().model.layers)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == layers * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trained)
    adapter = sum(p.numel() for p in trained.values())
    assert train_flops_per_token(model) == 4 * parameter_count(model) + 2 * adapter  # no weight grads for the base
    frozen_before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}

    ids = torch.randint(0, 200, (2, 32))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert all(torch.equal(p.full_tensor(), frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)

    # The checkpoint holds the adapter and its optimizer state, not the base (nor the tied LM head).
    save_checkpoint(tmp_path / "ckpt", model, optimizer, TrainerState(step=4), rank=0)
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == set(trained)
    assert sum(1 for k in saved if k.startswith("optim.state.") and k.endswith(".exp_avg")) == len(trained)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    again, opt2, sched2 = fresh()
    assert load_checkpoint(tmp_path / "ckpt", again, opt2, sched2, rank=0).step == 4
    with torch.no_grad():
        assert torch.equal(again.eval()(input_ids=ids).logits, logits)

    # The export is PEFT's adapter directory; peft and transformers load it onto the base and compute the same.
    export = Path(export_model(model, str(tiny_model_dir), str(tmp_path / "export"), torch.float32, {"run_name": "t"},
                               rank=0))
    assert export.parent == tmp_path / "export"  # a directory of its own under the run's export/: never reused
    assert sorted(p.name for p in export.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "rayline_export.json"]
    config = json.loads((export / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == "models:/b/3"
    in_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), export)
    in_transformers = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    in_transformers.load_adapter(str(export))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for loaded in (in_peft, in_transformers):
            assert torch.allclose(loaded.eval()(input_ids=ids).logits, logits, atol=1e-5)
        assert not torch.allclose(base.eval()(input_ids=ids).logits, logits, atol=1e-3)  # the adapter does change it

    # vLLM (CPU, enable_lora) loads it too: for the same prompts, its greedy tokens with the adapter are peft's with
    # the adapter, and differ from the base's (which vLLM gives without it) wherever peft's do. The tiny model's greedy
    # answer is often one token repeated, which a short training run may leave as it was for some prompts: of these
    # prompts, at least one is changed. In a process of its own, as an engine runs.
    prompts = [ids[0, :16], ids[1, :16], ids[0, 8:24], ids[1, 8:24]]
    expected = {"adapter": [], "base": []}
    for name, m in (("adapter", in_peft), ("base", base)):
        for prompt in prompts:
            out = prompt.clone()
            with torch.no_grad():
                for _ in range(TOKENS):
                    out = torch.cat([out, m(input_ids=out[None]).logits[0, -1].argmax()[None]])
            expected[name].append(out[len(prompt):].tolist())
    changed = [i for i, (a, b) in enumerate(zip(expected["adapter"], expected["base"])) if a != b]
    assert changed, expected  # the adapter changes peft's greedy tokens on some prompt
    code = (
        "import json, sys\n"
        "from vllm import LLM, SamplingParams\n"
        "from vllm.lora.request import LoRARequest\n"
        "base, adapter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
        "llm = LLM(model=base, enable_lora=True, max_lora_rank=8, max_loras=1, kv_cache_memory_bytes=64 << 20,\n"
        "          max_model_len=256, dtype='float32', enforce_eager=True)\n"
        f"sp = SamplingParams(max_tokens={TOKENS}, temperature=0)\n"
        "run = lambda **kw: [list(o.outputs[0].token_ids) for o in\n"
        "                    llm.generate([{'prompt_token_ids': p} for p in prompts], sp, **kw)]\n"
        "print('TOKENS', json.dumps({'adapter': run(lora_request=LoRARequest('a', 1, adapter)), 'base': run()}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir), str(export),
                           json.dumps([p.tolist() for p in prompts])], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    in_vllm = json.loads(lines[-1][len("TOKENS "):])
    assert in_vllm["adapter"] == expected["adapter"], (in_vllm, expected)  # peft's greedy tokens
    assert in_vllm["base"] == expected["base"], (in_vllm, expected)
    assert all(in_vllm["adapter"][i] != in_vllm["base"][i] for i in changed), (changed, in_vllm)  # vLLM applied it


@pytest.fixture(scope="module")
def base_in_registry(tiny_model_dir, s3_bucket, local_stack):
    """The tiny model as version 1 of a registered base model, its files in S3, alias `base`."""
    name = f"rayline-test-base-{uuid.uuid4().hex[:6]}"
    uri = f"{s3_bucket}/lora-base/{name}"
    storage.copy_tree(str(tiny_model_dir), uri)
    mv = registry.register_checkpoint(name, uri)
    registry.set_alias(name, "base", mv.version)
    return name, mv.version


@pytest.fixture(scope="module")
def lora_run(make_train_config, run_stage, s3_bucket, base_in_registry, tmp_path_factory):
    """A LoRA run on the registered base (by alias), 2 FSDP2 workers, checkpoints in S3 every 3 steps, one restart
    allowed. A worker process is killed right after step 5: Ray Train restarts the group, which resumes from the step-3
    checkpoint. It is killed again after step 8, with no restart left: the job fails. The same submission again
    (as a RayJob's retry or a user would) continues from the step-6 checkpoint and registers the adapter."""
    name, _ = base_in_registry
    cfg = make_train_config(*LORA, f"model.path=models:/{name}@base", "checkpoint.max_failures=1",
                            storage=f"{s3_bucket}/train-tests/{uuid.uuid4().hex[:8]}")
    marker = tmp_path_factory.mktemp("lora-fault") / "fired"
    failed = run_stage("train", cfg, env=fault_env(at="5,8", marker=marker))
    run_id = registry.find_run(cfg.mlflow.experiment, cfg.run_name)
    between = {"status": registry.client().get_run(run_id).info.status if run_id else None,
               "newest": newest_trainer_state(storage.join(cfg.checkpoint.storage_path, cfg.run_name))}
    again = run_stage("train", cfg)
    return cfg, failed, between, again, marker


@pytest.mark.timeout(1800)
def test_lora_run_resumes_after_lost_workers_and_when_submitted_again_and_registers_an_adapter_of_its_base(
        lora_run, base_in_registry, history, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, failed, between, run, marker = lora_run
    run_uri = storage.join(cfg.checkpoint.storage_path, cfg.run_name)
    # The first job: restarted once in-job from step 3, then failed with no restart left after step 8, its MLflow
    # run FAILED and its newest checkpoint at step 6.
    assert marker.read_text().splitlines() == ["killed rank 1 after step 5", "killed rank 1 after step 8"]
    assert failed.returncode == 1 and failed.result is None, str(failed)
    assert f"resumed from {run_uri.removeprefix('s3://')}/checkpoint_step000003 at step 3" in failed.stdout, str(failed)
    assert between["status"] == "FAILED" and between["newest"] and between["newest"][1].step == 6, between
    # The same submission again: the same MLflow run, continued from step 6 to the end.
    assert run.returncode == 0 and run.result, str(run)
    result = run.result
    base_name, base_version = base_in_registry
    assert result["final_step"] == 12
    run_id = result["mlflow_run_id"]
    assert run_id == registry.find_run(cfg.mlflow.experiment, cfg.run_name)
    assert registry.client().get_run(run_id).info.status == "FINISHED"
    assert f"resumed from {run_uri.removeprefix('s3://')}/checkpoint_step000006 at step 6" in run.stdout, str(run)
    # Each resume restored the step, the adapter's Adam state and its step count as checkpointed.
    assert history.values(run_id, "resume/step") == [(3, 3.0), (6, 6.0)]
    assert history.values(run_id, "resume/adam_step") == [(3, 3.0), (6, 6.0)]
    for step in (3, 6):
        saved = history.curve(run_id, "checkpoint/adam_m_sumsq")[step]
        assert saved > 0 and history.curve(run_id, "resume/adam_m_sumsq")[step] == pytest.approx(saved, rel=1e-9)
    history.assert_resumed(run_id, [(3, 5), (6, 8)], total=12)
    # Its checkpoints hold the adapter only: 2 matrices per targeted projection per layer.
    layers = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers
    ckpt = storage.local_copy(result["checkpoint_uri"], tmp_path / "ckpt")
    keys = [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert len(keys) == layers * len(cfg.lora.target_modules) * 2 and all(".lora_" in k for k in keys), keys[:5]

    # The export: an adapter that peft loads onto the base, scoring the eval split as the job did, and better than
    # the base alone.
    export = Path(storage.local_copy(result["export_uri"], tmp_path / "export"))
    assert not (export / "model.safetensors").exists() and (export / ADAPTER_WEIGHTS).exists()
    adapter_cfg = json.loads((export / ADAPTER_CONFIG).read_text())
    assert adapter_cfg["base_model_name_or_path"] == f"models:/{base_name}/{base_version}"
    manifest = load_manifest(cfg.data.manifest_uri)
    fs, path = storage.resolve(manifest["splits"]["eval"]["path"])
    table = pq.read_table(path, filesystem=fs)
    batch = {k: torch.tensor(table.column(k).to_pylist()) for k in COLUMNS}
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), export).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        loss = {name: float(forward_loss_sum(m, batch, torch.device("cpu"), torch.float32)) / loss_tokens(batch)
                for name, m in (("tuned", tuned), ("base", base))}
    assert loss["tuned"] == pytest.approx(result["eval_loss"], rel=0.05)
    assert loss["base"] == pytest.approx(result["first_eval_loss"], rel=0.05)
    assert loss["tuned"] < loss["base"] - 0.5, loss

    # Registered as a version of its own model, tagged as an adapter of the exact base version (the alias resolved).
    mv = registry.get_version(f"models:/{result['model_name']}/{result['model_version']}")
    assert mv.tags[registry.TAG_ADAPTER] == "lora" and mv.tags[registry.TAG_LORA_RANK] == "8"
    assert mv.tags[registry.TAG_BASE_MODEL] == f"models:/{base_name}/{base_version}"
    assert mv.tags[registry.TAG_DATASET_VERSION] == manifest["version"]
    assert mv.tags[registry.TAG_GIT_COMMIT] == registry.git_commit()


def test_tune_searches_lora_rank_alpha_and_learning_rate():
    from train.tune_config import TuneConfig, trial_config

    data = {"search_name": "lora-search", "train_config": "configs/train/tiny.yaml",
            "train_overrides": ["lora.enabled=true", "train.eval_every_steps=4", "train.checkpoint_every_steps=4"],
            "space": {"lora.rank": {"type": "choice", "values": [4, 8, 16]},
                      "lora.alpha": {"type": "uniform", "low": 8.0, "high": 64.0},
                      "optim.lr": {"type": "loguniform", "low": 1.0e-3, "high": 3.0e-2}}}
    cfg = from_dict(TuneConfig, data, "tune.yaml")
    trial = trial_config(cfg.base_train_config(), {"lora.rank": 16, "lora.alpha": 40.0, "optim.lr": 0.01}, "t1")
    assert (trial.lora.enabled, trial.lora.rank, trial.lora.alpha, trial.optim.lr) == (True, 16, 40.0, 0.01)
    # A sampled value the train config refuses is named before any trial starts.
    bad = {**data, "space": {"lora.rank": {"type": "randint", "low": 0, "high": 9}}}
    with pytest.raises(ConfigError, match=r"space.lora.rank: value 0 makes an invalid train config: .*lora.rank: "
                                          r"must be >= 1, got 0"):
        from_dict(TuneConfig, bad, "tune.yaml")
