"""Group-relative advantages (DeepSeekMath's GRPO): each sample's reward against its prompt's G samples."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """`rewards` ordered group by group (G = `group_size` consecutive samples per prompt) -> reward minus its group's
    mean, divided by the group's standard deviation when `scale` (as TRL's `scale_rewards="group"`). A group whose
    samples all scored the same gets 0: it says nothing about which sample was better."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
