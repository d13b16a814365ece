"""Build the Hugging Face causal LM and shard it with FSDP2 over a 1-D device mesh.

`fully_shard` goes on every decoder layer, then on the root (embeddings, final norm and the LM head,
which stay together so tied embeddings remain one parameter); with `model.fsdp_unit: model`, on the root only
(one unit, gathered once per step). FSDP2 also runs on CPU with gloo, which is what the CPU tests use; FSDP1
does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from train.config import LoraConfig
from train.lora import apply_lora


def device_mesh(device: torch.device) -> DeviceMesh:
    """All ranks on one data-parallel axis."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (Llama, Qwen, Mistral, ... keep them at `model.model.layers`),
    also under a peft wrapper."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `model.layers` list of decoder layers to shard")
    return list(layers)


def load_model(model_dir: str, attn_implementation: str, activation_checkpointing: bool) -> torch.nn.Module:
    """The base model in fp32 on CPU (FSDP2 moves each shard to the mesh's device)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    if activation_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's per-layer all-gather hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, bf16: bool, unit: str = "layer") -> torch.nn.Module:
    """Apply FSDP2 to each decoder layer and the root (`unit` "layer"), or to the root alone, kept gathered from
    forward through backward (`unit` "model"); bf16 compute keeps fp32 master weights and reductions.

    Under LoRA the root is the peft wrapper (its forward calls the base model's `forward` directly, past any
    hooks on the base), and each layer's frozen base weights are sharded beside its trainable adapter."""
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    if unit == "model":
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        return model
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # Backward starts with the last layer, so keeping it gathered after forward saves an all-gather.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_sharded_model(model_dir: str, device: torch.device, attn_implementation: str = "sdpa",
                        activation_checkpointing: bool = False, bf16: bool = False,
                        lora: LoraConfig | None = None, base_model_ref: str = "", fsdp_unit: str = "layer"
                        ) -> torch.nn.Module:
    """Load, shard (`fsdp_unit`: see ModelConfig) and return the model ready for training on `device`; with `lora`
    enabled, a LoRA adapter on the frozen base (`base_model_ref` goes into its adapter config)."""
    model = load_model(model_dir, attn_implementation, activation_checkpointing)
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora, base_model_ref or model_dir)
    model = shard_model(model, device_mesh(device), bf16, fsdp_unit)
    model.train()
    return model

