"""GRPO on Ray: a vLLM rollout pool, a verifier reward, group-relative advantages and a torch policy, one concern per
module (config, prompts, rewards, advantages, loss, rollout_pool, weight_sync, policy, ledger, loop, tracking)."""
