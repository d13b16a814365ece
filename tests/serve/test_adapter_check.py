"""The gate's adapter checks (serve/online/adapter_check.py) on real PEFT adapters of the tiny model: a good one passes,
and each way an adapter can fail to fit its base, or be served by vLLM 0.32 otherwise than peft applies it, is named
before any engine sees it. Each refusal is set beside what vLLM's own loader does with the same directory
(`vllm_loads`: the worker's PEFTHelper and LoRAModel, no engine): it refuses too, or it takes the adapter and would
serve something else (docs/LORA_SERVING.md section 6)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest

from serve.online.adapter_check import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKED, REFUSED, SERVED_AS_PEFT, VLLM_INITS,
                                 VLLM_LM_HEAD_LORA, adapter_problems, is_adapter)

# The modules vLLM 0.32's worker expects LoRA on for its LlamaForCausalLM (WorkerLoRAManager._load_adapter: the
# LinearBase suffixes, packed qkv_proj/gate_up_proj as their parts, and embedding_modules); pinned below.
LLAMA_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                      "lm_head"}
DROP = object()


def build(base_dir, out, **lora):
    """A PEFT adapter of `base_dir` written by peft: rank 4 on q_proj and v_proj unless `lora` says otherwise."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
                           **lora})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    model.save_pretrained(out)
    return model


def edit_config(path, **changes):
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    config.update(changes)
    (path / ADAPTER_CONFIG).write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))


def edit_weights(path, add=(), drop=()):
    import torch
    from safetensors.torch import load_file, save_file

    weights = {k: v for k, v in load_file(path / ADAPTER_WEIGHTS).items() if k not in drop}
    save_file({**weights, **{k: torch.zeros(shape) for k, shape in add}}, path / ADAPTER_WEIGHTS)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A rank-4 PEFT adapter of the tiny model on q_proj and v_proj, written by peft itself."""
    out = tmp_path_factory.mktemp("adapter")
    build(tiny_model_dir, out)
    return out


@pytest.fixture
def copy_of(adapter_dir, tmp_path):
    def copy():
        return shutil.copytree(adapter_dir, tmp_path / "adapter")
    return copy


@pytest.fixture(scope="module")
def vllm_loads(tiny_model_dir):
    """vLLM 0.32's own adapter loading as its worker runs it for the tiny Llama (WorkerLoRAManager._load_adapter):
    `load(dir)` is PEFTHelper.from_local_dir + validate_legal, then LoRAModel.from_local_checkpoint; it returns the
    LoRAModel (module -> the matrices the engine would apply) or raises what vLLM raises. `helper(dir)` is the
    PEFTHelper, whose get_rank_and_scaling is what the engine scales each module by."""
    pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]

    def helper(path):
        return PEFTHelper.from_local_dir(str(path), max_position_embeddings=512)

    def load(path, max_lora_rank=8):
        peft_helper = helper(path)
        peft_helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank))
        return LoRAModel.from_local_checkpoint(str(path), LLAMA_LORA_MODULES, peft_helper, lora_model_id=1,
                                               device="cpu", model_vocab_size=vocab)

    return SimpleNamespace(load=load, helper=helper, PEFTHelper=PEFTHelper, LoRAConfig=LoRAConfig)


def test_a_good_adapter_passes_and_is_told_from_a_full_model(adapter_dir, tiny_model_dir, vllm_loads):
    assert adapter_problems(str(adapter_dir), str(tiny_model_dir), max_lora_rank=8) == []
    assert is_adapter(str(adapter_dir)) and not is_adapter(str(tiny_model_dir))
    assert len(vllm_loads.load(adapter_dir).loras) == 2 * 4  # q_proj and v_proj of the 4 layers


@pytest.mark.parametrize("lora", [
    dict(target_modules=r".*\.(q_proj|v_proj|down_proj)$", use_rslora=True,
         rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
         alpha_pattern={"v_proj": 3, "layers.0.self_attn.q_proj": 32}),
    dict(target_modules=["q_proj", "o_proj"], layers_to_transform=[0, 2], layers_pattern="layers", lora_alpha=5),
    dict(target_modules="all-linear", exclude_modules=["o_proj"], init_lora_weights="gaussian", fan_in_fan_out=True),
], ids=["regex-patterns-rslora", "layers_to_transform", "all-linear-exclude"])
def test_what_vllm_serves_as_peft_applies_it_passes(lora, tiny_model_dir, tmp_path, vllm_loads):
    """Module selection and scaling: vLLM applies exactly peft's modules, at peft's rank and scaling."""
    from peft.tuners.lora import LoraLayer

    model = build(tiny_model_dir, tmp_path / "adapter", **lora)
    assert adapter_problems(str(tmp_path / "adapter"), str(tiny_model_dir), 8) == []
    peft_layers = {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, LoraLayer)}
    assert set(vllm_loads.load(tmp_path / "adapter").loras) == set(peft_layers)
    helper = vllm_loads.helper(tmp_path / "adapter")
    for name, m in peft_layers.items():
        assert helper.get_rank_and_scaling(name) == (m.r["default"], pytest.approx(m.scaling["default"])), name


def test_a_rank_above_the_engines_max_lora_rank_is_refused(adapter_dir, tiny_model_dir, copy_of, vllm_loads):
    problems = adapter_problems(str(adapter_dir), str(tiny_model_dir), max_lora_rank=1)
    assert problems == [f"{adapter_dir}/{ADAPTER_CONFIG}: r=4 exceeds the serving max_lora_rank 1"]
    broken = copy_of()
    edit_config(broken, rank_pattern={"q_proj": 16})  # vLLM takes the largest rank_pattern value, matched or not
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_CONFIG}: rank_pattern gives 'q_proj' rank 16, above the serving max_lora_rank 8"]
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        vllm_loads.load(broken)


# (id, peft's LoraConfig arguments from the peft module, or None, adapter_config.json edits of the good adapter,
#  the gate's reason after "<adapter>/adapter_config.json: ", what vLLM 0.32 raises on it, None where it loads it)
CONFIG_CASES = [
    ("dora", lambda peft: dict(use_dora=True), {}, "use_dora=True: DoRA, which vLLM 0.32 refuses",
     "vLLM does not yet support DoRA"),
    ("lora_bias", lambda peft: dict(lora_bias=True), {}, "lora_bias=True: a bias on lora_B, which vLLM 0.32 refuses",
     r"does not support LoRA bias \(lora_bias\)"),
    ("bias", lambda peft: dict(bias="all"), {}, "bias='all': vLLM 0.32 refuses adapter biases (only 'none')",
     "Adapter bias is not supported"),
    ("modules_to_save", lambda peft: dict(modules_to_save=["lm_head"]), {},
     "modules_to_save=['lm_head']: vLLM 0.32 refuses full modules other than a classification head ('classifier', "
     "'score')", r"Unsupported modules_to_save: \['lm_head'\]"),
    ("pissa", lambda peft: dict(init_lora_weights="pissa"), {},
     "init_lora_weights='pissa': vLLM 0.32 refuses it (PiSSA, OLoRA, CorDA and LoftQ change the base weights too); "
     "convert it with peft's path_initial_model_for_weight_conversion", "does not support init_lora_weights='pissa'"),
    ("alora", lambda peft: dict(alora_invocation_tokens=[5, 6]), {},
     "alora_invocation_tokens=[5, 6]: Activated LoRA, which vLLM 0.32 refuses", r"does not support Activated LoRA"),
    ("layer_replication", None, {"layer_replication": [[0, 2], [1, 4]]},
     "layer_replication=[[0, 2], [1, 4]]: layer replication, which vLLM 0.32 refuses",
     "does not support layer_replication"),
    ("qalora", None, {"use_qalora": True}, "use_qalora=True: QALoRA, which vLLM 0.32 refuses",
     "does not support QALoRA"),
    ("bdlora", None, {"use_bdlora": {"target_modules_bd_a": ["q_proj"]}},
     "use_bdlora={'target_modules_bd_a': ['q_proj']}: block-diagonal LoRA, which vLLM 0.32 refuses",
     r"does not support block-diagonal LoRA"),
    ("velora", lambda peft: dict(velora_config=peft.VeloraConfig()), {},
     "velora_config={'init_type': 'batch_average', 'num_groups': 64, 'scale': 1.0}: VeLoRA, whose buffers vLLM 0.32 "
     "cannot map", "lora_velora_embed is unsupported LoRA weight"),
    ("monteclora", lambda peft: dict(monteclora_config=peft.MontecloraConfig()), {},
     "monteclora_config={'buffer_size': 150, 'dirichlet_prior': 0.1, 'kl_loss_weight': 1e-05, 'num_samples': 8, "
     "'sample_scaler': 0.0001, 'use_entropy': False}: MonteCLoRA, whose sampler vLLM 0.32 cannot map",
     "is unsupported LoRA weight"),
    ("kasa", lambda peft: dict(kasa_config=peft.KasaConfig()), {},
     "kasa_config={'beta': 0.0001, 'gamma': 0.001}: KaSA, whose singular values vLLM 0.32 cannot map (and whose base "
     "truncation it does not do)", "lora_diag is unsupported LoRA weight"),
    ("arrow", None, {"arrow_config": {"top_k": 3}},
     "arrow_config={'top_k': 3}: Arrow routing, which vLLM 0.32 ignores (it would serve plain LoRA)", None),
    ("trainable_tokens", lambda peft: dict(trainable_token_indices=[0, 1]), {},
     "trainable_token_indices=[0, 1]: trained token embeddings, whose trainable_tokens_delta vLLM 0.32 cannot map",
     "trainable_tokens_delta is unsupported LoRA weight"),
    ("target_parameters", None, {"target_parameters": ["mlp.experts.gate_up_proj"]},
     "target_parameters=['mlp.experts.gate_up_proj']: LoRA on parameters (MoE experts), which this gate does not "
     "check (linear layers only)", None),
    ("peft_type", None, {"peft_type": "LOHA"},
     "peft_type='LOHA': only LORA adapters can be served (vLLM 0.32 reads any adapter_config.json as LoRA)", None),
    ("no_lora_alpha", None, {"lora_alpha": DROP},
     "has no lora_alpha (vLLM 0.32 requires r, lora_alpha and target_modules)",
     r"Missing required configuration fields: \{'lora_alpha'\}"),
    ("unknown_field", None, {"future_option": True},
     "future_option=True is unknown to peft {peft}, so neither rayline nor vLLM 0.32 knows what it changes", None),
]


@pytest.mark.parametrize("lora, edits, reason, vllm_raises", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_vllm_refuses_or_serves_otherwise_is_refused(lora, edits, reason, vllm_raises, copy_of, tiny_model_dir,
                                                            tmp_path, vllm_loads):
    import peft

    if lora:
        path = tmp_path / "built"
        build(tiny_model_dir, path, **lora(peft))
    else:
        path = copy_of()
    edit_config(path, **edits)
    assert adapter_problems(str(path), str(tiny_model_dir), 8) == [
        f"{path}/{ADAPTER_CONFIG}: {reason.replace('{peft}', peft.__version__)}"]
    if vllm_raises:
        with pytest.raises(ValueError, match=vllm_raises):
            vllm_loads.load(path)
    else:
        assert len(vllm_loads.load(path).loras) == 8  # vLLM takes it and would serve plain LoRA


def test_every_peft_lora_field_is_classed():
    """A peft upgrade that adds a LoraConfig field fails here until the field is classed (and refused meanwhile, as
    unknown); every peft LoRA variant is refused; the init variants vLLM takes (mica) run plain LoRA's forward."""
    from peft import LoraConfig

    fields = {f.name: f for f in dataclasses.fields(LoraConfig)}
    assert set(fields) == SERVED_AS_PEFT | CHECKED | set(REFUSED)
    assert not SERVED_AS_PEFT & set(REFUSED) and not CHECKED & set(REFUSED)
    assert {n for n, f in fields.items() if f.metadata.get("is_lora_variant")} <= set(REFUSED)
    assert set(fields["init_lora_weights"].metadata["lora_variants"]) <= VLLM_INITS


def test_the_vllm_rules_the_gate_copies_hold(vllm_loads):
    """The inits and the LM-head architectures the gate takes are those vLLM 0.32 takes, read from vLLM itself."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    for init in VLLM_INITS | {True, False}:
        helper = vllm_loads.PEFTHelper.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                                  "init_lora_weights": init})
        helper.validate_legal(vllm_loads.LoRAConfig(max_lora_rank=8))
    for arch in VLLM_LM_HEAD_LORA:
        module, name = _VLLM_MODELS[arch]
        model_cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
        assert "lm_head" in model_cls.embedding_modules, arch
    from vllm.model_executor.models.llama import LlamaForCausalLM

    parts = {p for ps in LlamaForCausalLM.packed_modules_mapping.values() for p in ps}
    assert parts | set(LlamaForCausalLM.embedding_modules) | {"o_proj", "down_proj"} == LLAMA_LORA_MODULES


def test_missing_weights_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    (broken / ADAPTER_WEIGHTS).unlink()
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [f"{broken}: {ADAPTER_WEIGHTS} is missing"]


def test_target_modules_the_base_lacks_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    edit_config(broken, target_modules=["q_proj", "v_proj", "c_attn"])
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


def test_a_rank_pattern_missing_from_the_config_is_refused_by_shape(tiny_model_dir, tmp_path, vllm_loads):
    """vLLM would scale the rank-8 q_proj matrices by alpha/r = 8/4 where peft, reading the same config, refuses
    them; with the rank_pattern they were trained with, peft and vLLM both scale by 8/8."""
    path = tmp_path / "adapter"
    build(tiny_model_dir, path, rank_pattern={"q_proj": 8})
    edit_config(path, rank_pattern={})
    problems = adapter_problems(str(path), str(tiny_model_dir), 8)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert len(problems) == 2 * 4 and problems[0] == (
        f"{path}/{ADAPTER_WEIGHTS}: {key} has shape [8, 128], the base's model.layers.0.self_attn.q_proj needs "
        f"[4, 128] (an adapter of another base, or of another rank than r=4)")
    lora = vllm_loads.load(path).loras["model.layers.0.self_attn.q_proj"]
    assert lora.lora_a.shape[0] == 8 and lora.scaling == 2.0


def test_a_cut_short_weights_file_and_a_bad_config_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    data = (broken / ADAPTER_WEIGHTS).read_bytes()
    (broken / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    problems = adapter_problems(str(broken), str(tiny_model_dir), 8)
    assert len(problems) == 1 and "cut short" in problems[0], problems
    (broken / ADAPTER_CONFIG).write_text('{"peft_type": "LORA", "r": 0}')
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_CONFIG}: r=0 is not a positive integer"]


def test_weights_on_layers_the_base_lacks_are_named(copy_of, tiny_model_dir):
    broken = copy_of()
    key = "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"
    edit_weights(broken, add=[(key, [4, 128])])
    problems = adapter_problems(str(broken), str(tiny_model_dir), 8)
    assert problems == [f"{broken}/{ADAPTER_WEIGHTS}: {key} sits on model.layers.9.self_attn.q_proj, which the base "
                        f"{tiny_model_dir} does not have"]


def test_weights_peft_ignores_are_refused(copy_of, tiny_model_dir, vllm_loads):
    """layers_to_transform (like target_modules and exclude_modules) is read by peft and ignored by vLLM, which
    applies every matrix in the file."""
    broken = copy_of()
    edit_config(broken, layers_to_transform=[0, 1], layers_pattern="layers")
    modules = [f"model.layers.{i}.self_attn.{m}" for i in (2, 3) for m in ("q_proj", "v_proj")]
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_WEIGHTS}: base_model.model.{m}.lora_{ab}.weight: {ADAPTER_CONFIG} does not target {m} "
        f"(target_modules, exclude_modules, layers_to_transform), so peft ignores it, but vLLM 0.32 applies every "
        f"LoRA matrix in the file" for m in modules for ab in "AB"]
    assert len(vllm_loads.load(broken).loras) == 8  # all four layers, where peft applies two


def test_a_half_pair_is_refused(copy_of, tiny_model_dir, vllm_loads):
    broken = copy_of()
    edit_weights(broken, drop=["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_WEIGHTS}: no lora_A/lora_B pair for 1 module(s) that {ADAPTER_CONFIG} targets "
        f"(model.layers.0.self_attn.q_proj): vLLM 0.32 fails on a half pair and serves nothing for a missing one, "
        f"where peft keeps its initial weights"]
    # vLLM's loader takes it; adding it then fails where lora_B is scaled (_create_merged_loras_inplace)
    assert vllm_loads.load(broken).loras["model.layers.0.self_attn.q_proj"].lora_b is None


def test_lora_on_the_token_embedding_is_refused(copy_of, tiny_model_dir, tmp_path):
    built = tmp_path / "built"
    build(tiny_model_dir, built, target_modules=["embed_tokens", "q_proj"])
    reason = ("vLLM 0.32 takes it only on some architectures, and rayline's fix for LoRA on CPU "
              "(serve/online/vllm_cpu_lora.py) does not cover it; target linear layers")
    assert adapter_problems(str(built), str(tiny_model_dir), 8) == [
        f"{built}/{ADAPTER_CONFIG}: target_modules ['embed_tokens'] put LoRA on the token embedding: {reason}"]
    broken = copy_of()
    keys = [f"base_model.model.model.embed_tokens.lora_embedding_{ab}" for ab in "AB"]
    edit_weights(broken, add=[(keys[0], [4, 469]), (keys[1], [128, 4])])
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_WEIGHTS}: {k} is LoRA on the token embedding: {reason}" for k in keys]


def test_a_resized_vocabulary_vllm_would_drop_is_refused(copy_of, tiny_model_dir, vllm_loads):
    broken = copy_of()
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    edit_weights(broken, add=[(key, [469 + 2, 128])])
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [
        f"{broken}/{ADAPTER_WEIGHTS}: {key} has shape [471, 128], the base {tiny_model_dir}'s model.embed_tokens is "
        f"[469, 128]: a resized vocabulary (new tokens) that vLLM 0.32 drops without a word, serving the base's"]
    assert "model.embed_tokens" not in vllm_loads.load(broken).loras  # loaded, the new embedding gone


def test_lora_on_the_lm_head_passes_only_where_vllm_takes_it(tiny_model_dir, tmp_path, vllm_loads):
    path = tmp_path / "adapter"
    build(tiny_model_dir, path, target_modules=["lm_head", "q_proj"])  # peft saves the tied embedding beside it
    assert adapter_problems(str(path), str(tiny_model_dir), 8) == []
    assert "lm_head" in vllm_loads.load(path).loras
    other = tmp_path / "other-base"
    other.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    assert adapter_problems(str(path), str(other), 8) == [
        f"{path}/{ADAPTER_WEIGHTS}: base_model.model.lm_head.lora_{ab}.weight is LoRA on the LM head: vLLM 0.32 takes "
        f"it only on architectures whose model lists lm_head in embedding_modules (of those rayline checks: "
        f"['LlamaForCausalLM']), and refuses the adapter on others" for ab in "AB"]


@pytest.mark.parametrize("key, shape, reason, vllm_raises", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", [128],
     "is DoRA's magnitude vector: vLLM 0.32 refuses DoRA", True),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", [128],
     "is a bias on lora_B (lora_bias): vLLM 0.32 refuses it", True),
    ("base_model.model.model.layers.0.self_attn.q_proj.bias", [128],
     "is a bias of the base layer (bias='all' or 'lora_only'): vLLM 0.32 refuses adapter biases", True),
    ("base_model.model.lm_head.weight", [469, 128], "is a full copy of lm_head (modules_to_save or "
     "save_embedding_layers): vLLM 0.32 serves a full module only as a classification model's head", True),
    ("model.layers.0.self_attn.o_proj.lora_A.weight", [4, 128], "is not a lora_A/lora_B matrix (vLLM 0.32 maps only "
     "base_model.model.<module>.lora_A/lora_B weights)", False),
], ids=["dora-magnitude", "lora_B-bias", "base-bias", "full-module", "unprefixed"])
def test_tensors_vllm_cannot_map_or_maps_otherwise_are_named(key, shape, reason, vllm_raises, copy_of, tiny_model_dir,
                                                             vllm_loads):
    broken = copy_of()
    edit_weights(broken, add=[(key, shape)])
    assert adapter_problems(str(broken), str(tiny_model_dir), 8) == [f"{broken}/{ADAPTER_WEIGHTS}: {key} {reason}"]
    if vllm_raises:
        with pytest.raises(ValueError, match="is unsupported LoRA weight"):
            vllm_loads.load(broken)
    else:  # vLLM takes a key without peft's prefix as it stands: o_proj, which peft's config does not target
        assert "model.layers.0.self_attn.o_proj" in vllm_loads.load(broken).loras
