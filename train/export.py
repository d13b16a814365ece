"""Export the sharded model as a plain Hugging Face checkpoint that transformers and vLLM load.

Every rank takes part in gathering the full state dict (offloaded to CPU); rank 0 writes
config.json, model.safetensors, generation_config.json, the tokenizer files and
`rayline_export.json` (lineage) to a local directory and copies it to the export URI. A LoRA run exports
its adapter only, in PEFT's format (train/lora.py).
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from core import storage
from train.lora import EXPORT_INFO, is_lora, write_adapter


def full_state_dict(model: torch.nn.Module, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: the unsharded weights (or only the trained ones: a LoRA adapter's) on rank 0's CPU (other
    ranks get an empty dict)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trained_only))


def write_hf_checkpoint(state_dict: dict[str, torch.Tensor], base_model_dir: str, out_dir: str | Path,
                        dtype: torch.dtype, info: dict) -> Path:
    """Write a loadable HF checkpoint from a full state dict, taking config and tokenizer from the base model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(base_model_dir)
    config.dtype = dtype
    config.use_cache = True
    # A meta-device shell gives save_pretrained the architecture (and tied-weight handling) without
    # allocating a second copy of the weights.
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    shell.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
    try:
        GenerationConfig.from_pretrained(base_model_dir).save_pretrained(out_dir)
    except OSError:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_model_dir).save_pretrained(out_dir)
    (out_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    return out_dir


def export_model(model: torch.nn.Module, base_model_dir: str, export_uri: str, dtype: torch.dtype, info: dict,
                 rank: int) -> str:
    """Collective: gather the weights and, on rank 0, write the HF checkpoint (under LoRA: PEFT's adapter
    directory) into a new directory under `export_uri` (local or s3://) and return it. A directory once written
    is never written again: a registered version's source keeps the bytes it was registered and evaluated with
    (a re-export after a restart goes to a directory of its own)."""
    lora = is_lora(model)
    state_dict = full_state_dict(model, trained_only=lora)
    if rank != 0:
        return export_uri
    export_uri = storage.join(export_uri, f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}")

    def write(out_dir) -> None:
        if lora:
            write_adapter(model, state_dict, out_dir, dtype, info)
        else:
            write_hf_checkpoint(state_dict, base_model_dir, out_dir, dtype, info)

    if not storage.is_remote(export_uri):
        write(Path(storage.resolve(export_uri)[1]))
        return export_uri
    with tempfile.TemporaryDirectory(prefix="rayline-export-") as tmp:
        write(tmp)
        storage.copy_tree(tmp, export_uri)
    return export_uri
