"""The seam where the trainer's weights reach the rollout engines: a vLLM worker extension.

vLLM 0.32 documents two RL weight-update paths: `weight_transfer_config` engines (NCCL, CUDA IPC, ...; GPU only,
the CPU worker builds none) and a worker extension class (`worker_extension_cls`) whose methods the front end calls
with `LLM.collective_rpc` and which loads new tensors through the model's own `load_weights` (the path vLLM's
RLHF examples take). On CPU this is the one that works; with the engine in the actor's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor `uni`) the call is in-process, so the tensors the actor got from Ray's
object store are loaded without another copy: no restart, no checkpoint written or read.
"""

from __future__ import annotations

from typing import Any

EXTENSION = "posttrain.grpo.weight_sync.PolicyWeightsExtension"
"""What the rollout engines pass as `worker_extension_cls`."""


class PolicyWeightsExtension:
    """Mixed into vLLM's worker (`self` is the worker): methods the rollout actor calls by name."""

    def load_policy_weights(self, named: dict[str, Any]) -> int:
        """Load `named` (Hugging Face parameter name -> tensor or array) into the running model through its
        `load_weights` (which maps HF names onto vLLM's fused layers); returns how many tensors were loaded."""
        import torch

        model = self.model_runner.get_model()  # both CPU model runners (v1, v2) have it
        items = [(name, torch.as_tensor(value)) for name, value in named.items()]
        model.load_weights(weights=iter(items))
        return len(items)
