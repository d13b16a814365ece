"""PEFT adapters of the tiny model for the LoRA tests (batch and serving), written by peft itself."""

from __future__ import annotations


def write_adapter(base_dir, out, seed: int | None):
    """A rank-4 PEFT adapter of `base_dir` on q_proj and v_proj: peft's initialisation (lora_B zero: a no-op)
    when `seed` is None, else random lora_A and lora_B from `seed`, scaled to change the answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed or 0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=seed is None)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    if seed is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.5)
    model.save_pretrained(out)
    return out
