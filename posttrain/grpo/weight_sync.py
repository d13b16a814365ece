"""The seam where the trainer's weights reach the rollout engines: a vLLM worker extension.

vLLM 0.32 documents two RL weight-update paths: `weight_transfer_config` engines (NCCL, CUDA IPC, ...; GPU only,
the CPU worker builds none) and a worker extension class (`worker_extension_cls`) whose methods the front end calls
with `LLM.collective_rpc`; rayline's hands the new tensors to the worker's in-place `reload_weights` (which runs
the model's own `load_weights` between undoing and redoing the CPU kernels' weight repacking). On CPU this is the
one that works; with the engine in the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor `uni`) the call
is in-process, so the tensors the actor got from Ray's object store are loaded without another copy: no restart, no
checkpoint written or read.
"""

from __future__ import annotations

from typing import Any

EXTENSION = "posttrain.grpo.weight_sync.PolicyWeightsExtension"
"""What the rollout engines pass as `worker_extension_cls`."""


class PolicyWeightsExtension:
    """Mixed into vLLM's worker (`self` is the worker): methods the rollout actor calls by name."""

    def load_policy_weights(self, named: dict[str, Any]) -> int:
        """Load `named` (Hugging Face parameter name -> tensor or array) into the running model in place (the
        model's `load_weights` maps HF names onto vLLM's fused layers); returns how many tensors were loaded."""
        import torch

        items = [(name, torch.as_tensor(value)) for name, value in named.items()]
        # Not the model's bare `load_weights`: on CPU, vLLM repacks each linear layer's weight for oneDNN after
        # loading and leaves an empty parameter behind. The worker's in-place reload (vllm/model_executor/
        # model_loader/reload) restores the checkpoint layout, loads, and repacks again.
        self.reload_weights(weights_iterator=iter(items))
        return len(items)
