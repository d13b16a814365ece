"""The GRPO objective (DeepSeekMath, as TRL's GRPOTrainer computes it with loss_type "grpo"): a PPO-style clipped
ratio per completion token times the sample's advantage, minus beta times the k3 estimate of KL to the reference,
averaged over each completion's tokens and then over the samples."""

from __future__ import annotations

import torch


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = 0.2, beta: float = 0.0, ref_logps: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token log-probs `logps` (current policy, with grad), `old_logps` (the policy that sampled), `ref_logps`
    (the reference; needed when `beta` > 0), all [B, T]; `advantages` [B]; `mask` [B, T] marks completion tokens.
    Returns the loss and its parts (mean KL, clipped fraction)."""
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    kl = torch.zeros_like(logps)
    if beta:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta > 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    mask = mask.to(logps.dtype)
    lengths = mask.sum(dim=1).clamp(min=1)
    loss = ((per_token * mask).sum(dim=1) / lengths).mean()
    clipped = ((ratio - 1).abs() > clip_eps).to(logps.dtype)
    with torch.no_grad():
        parts = {"kl": float(((kl * mask).sum(dim=1) / lengths).mean()),
                 "clip_fraction": float((clipped * mask).sum() / mask.sum().clamp(min=1))}
    return loss, parts
