"""A model's layers from its config.json alone: the architecture built on the meta device, no weight allocated or
read. What LoRA can target (the linear layers) and their shapes, for the train stage's preflight (train/lora.py)
and the rollout gate's adapter checks (serve/online/adapter_check.py)."""

from __future__ import annotations

import torch


def meta_model(model_config: dict) -> torch.nn.Module:
    """The architecture of a config.json (a dict), on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def linear_layers(model: torch.nn.Module | dict) -> dict[str, tuple[int, int]]:
    """Each linear layer's full name (`model.layers.0.self_attn.q_proj`) -> (in_features, out_features), of a
    model or of its config.json."""
    model = model if isinstance(model, torch.nn.Module) else meta_model(model)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def linear_module_names(model: torch.nn.Module | dict) -> set[str]:
    """The short names (`q_proj`, `down_proj`, ...) of the linear layers: what LoRA's `target_modules` name."""
    return {name.rsplit(".", 1)[-1] for name in linear_layers(model)}
