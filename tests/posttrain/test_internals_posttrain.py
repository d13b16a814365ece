"""Guards for the vLLM surface posttrain/ relies on (docs/INTERNALS.md, row G1). Fast: imports and source checks
only, no engine. vllm 0.32.0 (CPU) at the time of writing."""

from __future__ import annotations

import inspect


def test_cpu_worker_model_runner_gives_a_model_with_load_weights():
    """G1, posttrain/grpo/weight_sync.py: vLLM mixes `worker_extension_cls` into its worker, the CPU worker keeps its
    model runner at `self.model_runner` (either runner), each runner's `get_model()` returns the loaded model, and
    the Llama model's `load_weights` takes an iterable of (HF name, tensor)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.worker import cpu_worker, worker_base
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "worker_extension_cls" in inspect.getsource(worker_base)
    source = inspect.getsource(cpu_worker.CPUWorker)
    assert "self.model_runner = CPUModelRunner(" in source and "self.model_runner: CPUModelRunner = CPUModelRunnerV2(" in source
    assert callable(CPUModelRunner.get_model)
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    assert callable(CPUModelRunnerV2.get_model)
    assert list(inspect.signature(LlamaForCausalLM.load_weights).parameters) == ["self", "weights"]
    from vllm.entrypoints.llm import LLM

    assert {"method", "args"} <= set(inspect.signature(LLM.collective_rpc).parameters)
    assert callable(LLM.reset_prefix_cache)
