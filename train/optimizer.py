"""AdamW and its learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from train.config import OptimConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier on the peak lr for the update that follows `step` completed steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay on matrices only, not norms or biases) and its warmup + cosine scheduler."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel over all of a group's tensors (CPU and CUDA, DTensor shards too). torch's default on CPU is a
    # Python loop per tensor: 15 vs 3 ms a step for the tiny model's FSDP2 shards in a 2-rank gloo micro-benchmark.
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def adam_state_summary(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Fingerprints of the AdamW state over all ranks (step count, summed squares of both moments).

    A restore is checked against these: a fresh optimizer has step 0 and empty moments.
    """
    import torch.distributed as dist

    steps, sums = [0.0], torch.zeros(2, dtype=torch.float64)
    for state in optimizer.state.values():
        if "step" in state:
            steps.append(float(state["step"]))
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            if key in state:
                t = state[key]
                local = t.to_local() if hasattr(t, "to_local") else t
                sums[i] += float(local.double().pow(2).sum())
    if dist.is_available() and dist.is_initialized():
        device = next(iter(optimizer.state.values()))["exp_avg"].device if optimizer.state else torch.device("cpu")
        sums = sums.to(device)
        dist.all_reduce(sums)
    return {"adam_step": max(steps), "adam_m_sumsq": float(sums[0]), "adam_v_sumsq": float(sums[1])}
