"""Post-training stages on Ray: preference tuning (DPO) and reinforcement learning with verifiable rewards (GRPO)."""
