"""The promotion control plane: the gate, rollout, canary, deploy targets, webhook and verification."""
