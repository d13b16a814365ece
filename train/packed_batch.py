"""From a packed batch of the prepared dataset to model inputs, and the token-summed loss.

A packed row holds several documents: `segment_ids` numbers them 1..k (0 = padding) and
`position_ids` restart at each one. A token may attend only to earlier tokens of its own document,
so the mask is block-diagonal causal. It is passed to Hugging Face models as a 4D additive float
mask, which transformers 5 hands unchanged to the sdpa and eager attention kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, seq] segment ids -> [batch, 1, seq, seq] additive mask (0 = attend, dtype min = blocked).

    Padding (segment 0) attends causally to padding, so no row is fully masked (which would give NaN).
    """
    seq = segment_ids.shape[-1]
    same_doc = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (same_doc & causal).unsqueeze(1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kwargs for a causal LM forward on one packed batch."""
    input_ids = batch["input_ids"].to(device=device, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "position_ids": batch["position_ids"].to(device=device, dtype=torch.long),
        "attention_mask": block_causal_mask(batch["segment_ids"].to(device), dtype),
    }


def shifted_labels(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Labels are aligned with input_ids (as HF `labels`); logits at t predict the label at t+1."""
    labels = batch["labels"].to(device=device, dtype=torch.long)
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many tokens of the batch carry loss (after the shift)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies, so micro-batches and ranks can be normalised globally."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def forward_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
                     mask_dtype: torch.dtype) -> torch.Tensor:
    """One forward pass; returns the summed token loss of the batch."""
    logits = model(**model_inputs(batch, device, mask_dtype), use_cache=False).logits
    return token_loss_sum(logits, shifted_labels(batch, device))
