"""Post-training stages on the shared FSDP2 loop: preference tuning (DPO) and reinforcement learning (GRPO)."""
