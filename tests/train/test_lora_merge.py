"""train/lora.py merged_state_dict: a LoRA model's weights folded into its base's names, as GRPO hands a LoRA
policy to its rollout engines (posttrain/grpo/policy.py)."""

from __future__ import annotations

import torch

from train.config import LoraConfig
from train.lora import apply_lora, merged_state_dict


def test_merged_weights_load_into_the_base_and_compute_what_the_lora_model_does(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg, str(tiny_model_dir)).eval()
    with torch.no_grad():  # B starts at 0 (the adapter changes nothing): give it weights, as training would
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = merged_state_dict(model.state_dict(), cfg.alpha / cfg.rank)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert set(merged) == set(base.state_dict())  # the base's names, no adapter left
    base.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, base(input_ids=ids).logits
        untouched = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(untouched, want, atol=1e-3)  # the adapter did change what the model computes
