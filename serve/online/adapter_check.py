"""The gate's checks of a LoRA adapter against its base, before any engine loads it (issues 18 and 48).

One engine serves the base and every adapter of it, so one bad adapter must never reach it: vLLM on CPU raised a
raw tensor-size error on an adapter whose shapes did not fit the base and then hung, and loaded an adapter whose
target modules the base lacks silently, changing nothing. An adapter passes only if vLLM 0.32 serves it as peft
applies it, the way it was trained. The rules come from vLLM's own loader (`vllm/lora/peft_helper.py`,
`lora_model.py`, `utils.py`, `model_manager.py`; docs/LORA_SERVING.md section 6 lists each with the test):

- adapter_config.json: every field of peft's LoraConfig is classed below as served as peft does, checked, or
  refused; a field peft does not know is refused, so a new peft feature is refused until it is classed.
- adapter_model.safetensors (its header, never the weights): vLLM applies every LoRA matrix in the file and none of
  the config's module selection, so the matrices must be exactly those peft builds from the config on this base
  (peft's own injection on the meta device: target_modules, exclude_modules, layers_to_transform, rank_pattern),
  with peft's shapes; every other tensor is either refused by vLLM or dropped by it without a word.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import torch

from core import storage
from core.model_layout import linear_layers, meta_model
from core.weights_manifest import safetensors_header

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_[AB]\.weight|lora_embedding_[AB])$")
_PREFIX = "base_model.model."

# Fields vLLM 0.32 serves as peft applies them. Module selection (target_modules, exclude_modules,
# layers_to_transform, layers_pattern): vLLM ignores these fields and applies the matrices in the file, which is
# the same only while the file holds exactly peft's choice (checked against the weights). Scaling (lora_alpha,
# use_rslora, rank_pattern, alpha_pattern): PEFTHelper.get_rank_and_scaling matches patterns with peft's
# get_pattern_key rule and scales by alpha/r, or alpha/sqrt(r) under rsLoRA, as peft does (a test pins it).
# lora_dropout is training only; fan_in_fan_out changes how peft merges a Conv1D base weight, not the LoRA matrices
# or their forward (peft turns it off on nn.Linear); the *_config of an init method only matter with that init
# (init_lora_weights is checked); qalora_group_size only with use_qalora (refused); megatron_* only choose peft's
# layer classes; runtime_config is not saved; ensure_weight_tying only ties LoRA on the tied embedding, refused.
SERVED_AS_PEFT = frozenset({
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "lora_dropout", "fan_in_fan_out",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
    "megatron_config", "megatron_core", "runtime_config", "ensure_weight_tying",
})
# Fields with a check of their own in _config_problems.
CHECKED = frozenset({"peft_type", "r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "bias",
                     "modules_to_save", "init_lora_weights"})
# Fields refused whenever set: vLLM 0.32 refuses them (PEFTHelper._validate_features), cannot map the tensors peft
# saves with them, or ignores them and serves plain LoRA.
REFUSED = {
    "use_dora": "DoRA, which vLLM 0.32 refuses",
    "lora_bias": "a bias on lora_B, which vLLM 0.32 refuses",
    "alora_invocation_tokens": "Activated LoRA, which vLLM 0.32 refuses",
    "layer_replication": "layer replication, which vLLM 0.32 refuses",
    "use_bdlora": "block-diagonal LoRA, which vLLM 0.32 refuses",
    "use_qalora": "QALoRA, which vLLM 0.32 refuses",
    "velora_config": "VeLoRA, whose buffers vLLM 0.32 cannot map",
    "monteclora_config": "MonteCLoRA, whose sampler vLLM 0.32 cannot map",
    "kasa_config": "KaSA, whose singular values vLLM 0.32 cannot map (and whose base truncation it does not do)",
    "arrow_config": "Arrow routing, which vLLM 0.32 ignores (it would serve plain LoRA)",
    "trainable_token_indices": "trained token embeddings, whose trainable_tokens_delta vLLM 0.32 cannot map",
    "target_parameters": "LoRA on parameters (MoE experts), which this gate does not check (linear layers only)",
}
# init_lora_weights values vLLM 0.32 accepts (PEFTHelper._init_is_supported): inits that set only the first adapter
# weights, so the saved adapter is plain LoRA. PiSSA, OLoRA, CorDA and LoftQ also change the base weights.
VLLM_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})
# Architectures whose vLLM 0.32 model lists lm_head in `embedding_modules`: only these take LoRA on the LM head
# (others refuse the adapter at load). A test checks this against vLLM's own classes.
VLLM_LM_HEAD_LORA = frozenset({"LlamaForCausalLM"})
_EMBEDDING_LORA = ("vLLM 0.32 takes it only on some architectures, and rayline's fix for LoRA on CPU "
                   "(serve/online/vllm_cpu_lora.py) does not cover it; target linear layers")


def is_adapter(source: str) -> bool:
    """Whether the checkpoint at `source` is a PEFT adapter directory rather than a full model."""
    return storage.exists(storage.join(source, ADAPTER_CONFIG))


def _read_json(uri: str) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(storage.read_text(uri))
    except (OSError, ValueError) as e:
        return None, f"{uri}: unreadable ({e})"
    return (value, None) if isinstance(value, dict) else (None, f"{uri}: not a JSON object")


def _lora_fields() -> dict[str, dataclasses.Field]:
    from peft import LoraConfig

    return {f.name: f for f in dataclasses.fields(LoraConfig)}


def adapter_problems(source: str, base_source: str, max_lora_rank: int) -> list[str]:
    """What keeps the PEFT adapter at `source` from being served as trained on the base checkpoint at `base_source`
    by an engine started with `max_lora_rank`, if anything: one reason per problem, naming the file and field."""
    try:
        files = set(storage.list_files(source))
    except (OSError, ValueError) as e:
        return [f"{source}: cannot list the adapter ({e})"]
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if f not in files]
    if missing:
        return [f"{source}: {f} is missing" for f in missing]
    config, problem = _read_json(storage.join(source, ADAPTER_CONFIG))
    if problem:
        return [problem]
    base_config, problem = _read_json(storage.join(base_source, "config.json"))
    if problem:
        return [f"the base: {problem}"]
    model = meta_model(base_config)
    layers = linear_layers(model)
    embeddings = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    problems = _config_problems(config, f"{source}/{ADAPTER_CONFIG}", max_lora_rank, layers, embeddings, base_source)
    if problems:  # the weights are checked once the config is one vLLM serves as peft does
        return problems
    header, problem = safetensors_header(storage.join(source, ADAPTER_WEIGHTS))
    if problem:
        return [problem]
    base_weights = {name: list(m.weight.shape) for name, m in model.named_modules()
                    if isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
    expected, problem = _peft_view(config, model)  # changes `model`: after the base's own names are read
    if problem:
        return [f"{source}/{ADAPTER_CONFIG}: peft cannot apply it to the base {base_source} ({problem})"]
    lm_head_ok = bool(set(base_config.get("architectures") or []) & VLLM_LM_HEAD_LORA)
    return _weight_problems(header, layers, base_weights, expected, lm_head_ok, f"{source}/{ADAPTER_WEIGHTS}",
                            base_source)


def _config_problems(config: dict, where: str, max_lora_rank: int, layers: dict, embeddings: set[str],
                     base_source: str) -> list[str]:
    """adapter_config.json against what vLLM 0.32's PEFTHelper reads and refuses, and against the fields peft
    applies that vLLM does not."""
    import peft

    fields = _lora_fields()
    if config.get("peft_type") != "LORA":
        return [f"{where}: peft_type={config.get('peft_type')!r}: only LORA adapters can be served (vLLM 0.32 reads "
                f"any adapter_config.json as LoRA)"]
    rank = config.get("r")
    if not _is_int(rank) or rank < 1:
        return [f"{where}: r={rank!r} is not a positive integer"]
    problems = [f"{where}: has no {name} (vLLM 0.32 requires r, lora_alpha and target_modules)"
                for name in ("lora_alpha", "target_modules") if name not in config]
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"{where}: lora_alpha={alpha!r} is not a number")
    if rank > max_lora_rank:
        problems.append(f"{where}: r={rank} exceeds the serving max_lora_rank {max_lora_rank}")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            problems.append(f"{where}: {name}={config[name]!r} is not a mapping of module patterns")
            config = {**config, name: {}}
    for key, value in (config.get("rank_pattern") or {}).items():
        if not _is_int(value) or value < 1:  # vLLM refuses it (PEFTHelper.__post_init__)
            problems.append(f"{where}: rank_pattern gives {key!r} rank {value!r}, not a positive integer")
        elif value > max_lora_rank:  # vLLM checks the largest, matched or not (validate_legal)
            problems.append(f"{where}: rank_pattern gives {key!r} rank {value}, above the serving max_lora_rank "
                            f"{max_lora_rank}")
    for key, value in (config.get("alpha_pattern") or {}).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{where}: alpha_pattern gives {key!r} alpha {value!r}, not a number")
    if config.get("bias", "none") != "none":
        problems.append(f"{where}: bias={config['bias']!r}: vLLM 0.32 refuses adapter biases (only 'none')")
    to_save = config.get("modules_to_save") or []
    extra = [m for m in ([to_save] if isinstance(to_save, str) else to_save) if m not in ("classifier", "score")]
    if extra:
        problems.append(f"{where}: modules_to_save={extra!r}: vLLM 0.32 refuses full modules other than a "
                        f"classification head ('classifier', 'score')")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, bool) and str(init).lower() not in VLLM_INITS:
        problems.append(f"{where}: init_lora_weights={init!r}: vLLM 0.32 refuses it (PiSSA, OLoRA, CorDA and LoftQ "
                        f"change the base weights too); convert it with peft's "
                        f"path_initial_model_for_weight_conversion")
    for name, what in REFUSED.items():
        if config.get(name):
            problems.append(f"{where}: {name}={config[name]!r}: {what}")
    for name, value in config.items():
        if name not in fields and value not in (None, False, [], {}, ""):
            problems.append(f"{where}: {name}={value!r} is unknown to peft {peft.__version__}, so neither "
                            f"rayline nor vLLM 0.32 knows what it changes")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a str is a regex (or "all-linear"): peft's own matching decides, below
        short_names = {name.rsplit(".", 1)[-1] for name in layers}
        on_embedding = [t for t in targets if t in embeddings]
        if on_embedding:
            problems.append(f"{where}: target_modules {on_embedding} put LoRA on the token embedding: "
                            f"{_EMBEDDING_LORA}")
        lacking = [t for t in targets if t not in short_names and t not in embeddings]
        if lacking:
            problems.append(f"{where}: target_modules {lacking} are not linear layers of the base {base_source} "
                            f"(it has {sorted(short_names)})")
    return problems


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _peft_view(config: dict, model) -> tuple[dict[str, list[int]] | None, str | None]:
    """The LoRA tensors peft builds from `config` on `model` (the base on the meta device, changed in place):
    safetensors key -> shape, by peft's own injection (its target, exclude, layer and rank_pattern rules)."""
    from peft import PeftConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    fields = _lora_fields()
    try:
        peft_config = PeftConfig.from_peft_type(**{k: v for k, v in config.items() if k in fields})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on tied embeddings and the like; the checks speak
            inject_adapter_in_model(peft_config, model, low_cpu_mem_usage=True)
    except Exception as e:  # peft failing on the config in any way is a refusal, not a crash of the gate
        return None, f"{type(e).__name__}: {e}"
    expected = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = _PREFIX + name
        if "default" in module.lora_A:
            expected[f"{key}.lora_A.weight"] = list(module.lora_A["default"].weight.shape)
            expected[f"{key}.lora_B.weight"] = list(module.lora_B["default"].weight.shape)
        elif "default" in module.lora_embedding_A:
            expected[f"{key}.lora_embedding_A"] = list(module.lora_embedding_A["default"].shape)
            expected[f"{key}.lora_embedding_B"] = list(module.lora_embedding_B["default"].shape)
    return expected, None


def _weight_problems(header: dict, layers: dict[str, tuple[int, int]], base_weights: dict[str, list[int]],
                     expected: dict[str, list[int]], lm_head_ok: bool, where: str, base_source: str) -> list[str]:
    """Each tensor of the adapter file against what vLLM 0.32 does with it (lora_model.py from_lora_tensors,
    utils.py parse_fine_tuned_lora_name) and against `expected`, peft's tensors from the config."""
    problems, seen = [], set()
    for key, meta in sorted(header.items()):
        if key == "__metadata__":
            continue
        shape = list(meta.get("shape", []))
        match = _LORA_KEY.match(key)
        if not match:
            problem = _other_tensor_problem(key, shape, base_weights, base_source)
            if problem:
                problems.append(f"{where}: {problem}")
            continue
        module, kind = match["module"], match["kind"]
        seen.add(key)
        if kind.startswith("lora_embedding"):
            problems.append(f"{where}: {key} is LoRA on the token embedding: {_EMBEDDING_LORA}")
        elif module not in layers:
            problems.append(f"{where}: {key} sits on {module}, which the base {base_source} does not have")
        elif module.rsplit(".", 1)[-1] == "lm_head" and not lm_head_ok:
            problems.append(f"{where}: {key} is LoRA on the LM head: vLLM 0.32 takes it only on architectures "
                            f"whose model lists lm_head in embedding_modules (of those rayline checks: "
                            f"{sorted(VLLM_LM_HEAD_LORA)}), and refuses the adapter on others")
        elif key not in expected:
            problems.append(f"{where}: {key}: {ADAPTER_CONFIG} does not target {module} (target_modules, "
                            f"exclude_modules, layers_to_transform), so peft ignores it, but vLLM 0.32 applies "
                            f"every LoRA matrix in the file")
        elif shape != expected[key]:
            rank = expected[key][0 if kind.startswith("lora_A") else 1]
            problems.append(f"{where}: {key} has shape {meta.get('shape')}, the base's {module} needs "
                            f"{expected[key]} (an adapter of another base, or of another rank than r={rank})")
    absent = sorted({_LORA_KEY.match(k)["module"] for k in expected if k not in seen and "lora_embedding" not in k})
    if absent:
        problems.append(f"{where}: no lora_A/lora_B pair for {len(absent)} module(s) that {ADAPTER_CONFIG} targets "
                        f"({', '.join(absent[:4])}{', ...' if len(absent) > 4 else ''}): vLLM 0.32 fails on a half "
                        f"pair and serves nothing for a missing one, where peft keeps its initial weights")
    if not seen and not problems:
        problems.append(f"{where}: holds no LoRA weights")
    return problems


def _other_tensor_problem(key: str, shape: list[int], base_weights: dict[str, list[int]],
                          base_source: str) -> str | None:
    """Why a tensor that is not a LoRA matrix keeps the adapter from being served as trained, or None when vLLM
    0.32 drops it and that changes nothing."""
    name = key.removeprefix(_PREFIX)
    module = name.removesuffix(".base_layer.weight")
    if name.endswith(".base_layer.weight") and module.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head"):
        # peft saves the base's embedding beside LoRA on it; vLLM drops it without a word (is_base_embedding_weights)
        # and keeps the base's own, which is the same matrix unless the vocabulary was resized for new tokens.
        want = base_weights.get(module)
        if shape == want:
            return None
        return (f"{key} has shape {shape}, the base {base_source}'s {module} is {want}: a resized vocabulary (new "
                f"tokens) that vLLM 0.32 drops without a word, serving the base's")
    if name.endswith("lora_magnitude_vector") or ".lora_magnitude_vector." in name:
        return f"{key} is DoRA's magnitude vector: vLLM 0.32 refuses DoRA"
    if name.endswith(".lora_B.bias"):
        return f"{key} is a bias on lora_B (lora_bias): vLLM 0.32 refuses it"
    if name.endswith("trainable_tokens_delta"):
        return f"{key} holds trained token embeddings (trainable_token_indices): vLLM 0.32 cannot map it"
    if name.endswith(".bias"):
        return f"{key} is a bias of the base layer (bias='all' or 'lora_only'): vLLM 0.32 refuses adapter biases"
    module = name.removesuffix(".weight")
    if name.endswith(".weight") and (module in base_weights or module.rsplit(".", 1)[-1] in ("score", "classifier")):
        return (f"{key} is a full copy of {module} (modules_to_save or save_embedding_layers): vLLM 0.32 serves "
                f"a full module only as a classification model's head")
    return (f"{key} is not a lora_A/lora_B matrix (vLLM 0.32 maps only base_model.model.<module>.lora_A/lora_B "
            f"weights)")
