"""A fix for vLLM 0.32's LoRA on CPU: a request without an adapter, batched with requests that have one, was answered
with an adapter's weights.

vLLM marks a token of a request without an adapter with adapter slot index -1. Its GPU kernels skip such tokens;
its CPU ops (`vllm/lora/ops/torch_ops/lora_ops.py`, used by `PunicaWrapperCPU`) index the stacked weights with it
(`lora_a_weights[lora_indices_tensor]`), and -1 is Python's last slot. So in any batch that mixes the base with
an adapter, the base's tokens got the adapter in the last slot (with one adapter: always that adapter). Measured
on 2026-12-04 with the demo's base and adapter, 100 eval prompts, greedy: the base answered as the adapter on 99
of 100 when the same prompts were batched with the adapter's, and on 21 of 100 in the demo's batch eval job (its
"base" exact match was the adapter's, 0.20 instead of 0.03). In Serve, `rayline` requests running beside
`rayline:<adapter>` requests were answered the same way.

The fix zeroes the shrink (A) output of every token whose index is -1: its expand (B) then adds nothing, whatever
slot -1 selects. Every LoRA layer vLLM's CPU wrapper runs (linear, merged and logits) goes through `bgmv_shrink`
(`sgmv_shrink` for prefill calls it per token). Not covered: LoRA on the embeddings (`add_lora_embedding`
has no shrink); rayline's adapters target linear layers.

vLLM loads it in each of its processes as a general plugin (pyproject's `vllm.general_plugins` entry point), so
the EngineCore and workers a replica or a batch engine starts have it whether they fork or spawn. Idempotent.
"""

from __future__ import annotations

import functools

MARK = "_rayline_masks_no_adapter_tokens"


def mask_no_adapter_tokens(shrink):
    """`bgmv_shrink` that leaves zeros for the tokens of requests without an adapter (index -1)."""
    if getattr(shrink, MARK, False):
        return shrink

    @functools.wraps(shrink)
    def masked(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        none = lora_indices_tensor < 0
        if bool(none.any()):
            rows = min(none.shape[0], output_tensor.shape[0])
            output_tensor[:rows][none[:rows]] = 0

    setattr(masked, MARK, True)
    return masked


def register() -> None:
    """The vLLM general plugin: patch the CPU LoRA ops where they are looked up (the ops module, the package that
    re-exports them, and the CPU wrapper that imported them by name)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    masked = mask_no_adapter_tokens(lora_ops.bgmv_shrink)
    for module in (lora_ops, torch_ops, punica_cpu):
        if hasattr(module, "bgmv_shrink"):
            module.bgmv_shrink = masked
