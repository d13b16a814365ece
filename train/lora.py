"""LoRA on the FSDP2 loop (the train config's `lora` section): peft adapters on a frozen, sharded base.

Only the adapter matrices train: they alone are in the optimizer, in the DCP checkpoints (the frozen base is
left out, `ignore_frozen_params`) and in the export, which is PEFT's adapter directory
    adapter_config.json, adapter_model.safetensors   what peft, transformers and vLLM (`enable_lora`) load
    rayline_export.json                              lineage, as for a full export (base model version included)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.config import ConfigError
from core.model_layout import linear_module_names
from train.config import LoraConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
EXPORT_INFO = "rayline_export.json"


def check_target_modules(model: torch.nn.Module | dict, targets: list[str], where: str = "lora.target_modules") -> None:
    """Refuse targets the base lacks (given as a model or its config.json): an adapter on layers that are not
    there would either fail to load or, worse, load and change nothing."""
    known = linear_module_names(model)
    missing = [t for t in targets if t not in known]
    if missing:
        raise ConfigError(f"{where}: {missing} {'is' if len(missing) == 1 else 'are'} not a linear layer of the base "
                          f"model; it has {sorted(known)}")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, base_model_ref: str) -> torch.nn.Module:
    """Wrap the HF model in a peft LoRA model: base weights frozen, adapter weights trainable (B starts at 0, so
    the wrapped model computes exactly what the base does until the first step)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_target_modules(model, cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, peft_cfg)
    model.peft_config["default"].base_model_name_or_path = base_model_ref  # not the local path peft puts
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def trained_only(model: torch.nn.Module, state_dict: dict) -> dict:
    """The entries of the model's `state_dict` that train. Under LoRA that is the adapter alone: DCP's
    `ignore_frozen_params` misses a tied LM head (not a parameter of its own), which would put the whole
    embedding matrix into every checkpoint."""
    if not is_lora(model):
        return state_dict
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state_dict.items() if k in trained}


def write_adapter(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], out_dir: str | Path,
                  dtype: torch.dtype, info: dict) -> Path:
    """Write PEFT's adapter directory from the gathered adapter weights (`state_dict`, the model's own keys)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)  # none train
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(out_dir))
    (out_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    return out_dir


def merged_state_dict(state_dict: dict[str, torch.Tensor], scale: float, adapter: str = "default"
                      ) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (peft's keys) -> the base model's, each adapter folded into its layer:
    W + scale * B @ A (scale = alpha / rank) under the names the base checkpoint uses, what an engine loads."""
    prefix, base, lora = "base_model.model.", ".base_layer.", (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    out = {}
    for key, value in state_dict.items():
        if any(part in key for part in lora):
            continue
        if key.endswith(f"{base}weight") and f"{key[:-len(base + 'weight')]}{lora[0]}weight" in state_dict:
            stem = key[:-len(base + "weight")]
            a, b = state_dict[f"{stem}{lora[0]}weight"].float(), state_dict[f"{stem}{lora[1]}weight"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[key.removeprefix(prefix).replace(base, ".")] = value
    return out
