"""PEFT adapters of the tiny model for the LoRA tests (batch and serving), written by peft itself."""

from __future__ import annotations

from pipelines.tiny_model import build_adapter


def write_adapter(base_dir, out, seed: int | None):
    """A rank-4 PEFT adapter of `base_dir` on q_proj and v_proj: peft's initialisation (lora_B zero: a no-op)
    when `seed` is None, else random weights from `seed` that change the answers (pipelines/tiny_model.py)."""
    return build_adapter(base_dir, out, seed, rank=4)
