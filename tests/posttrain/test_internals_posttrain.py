"""Guards for the vLLM surface posttrain/ relies on (docs/INTERNALS.md, row G1). Fast: imports and source checks
only, no engine. vllm 0.32.0 (CPU) at the time of writing."""

from __future__ import annotations

import inspect


def test_cpu_worker_reloads_weights_in_place_from_an_iterator():
    """G1, posttrain/grpo/weight_sync.py: vLLM mixes `worker_extension_cls` into its worker; the CPU worker inherits
    the worker's `reload_weights`, which passes `weights_iterator` to the model runner's in-place reload
    (vllm/model_executor/model_loader/reload); `LLM.collective_rpc` calls a worker method by name."""
    from vllm.entrypoints.llm import LLM
    from vllm.model_executor.model_loader.reload import inplace
    from vllm.v1.worker import cpu_worker, gpu_worker, worker_base

    assert "worker_extension_cls" in inspect.getsource(worker_base)
    assert issubclass(cpu_worker.CPUWorker, gpu_worker.Worker)
    assert "reload_weights" not in vars(cpu_worker.CPUWorker)  # the inherited one, as checked here
    assert "self.model_runner.reload_weights(*args, **kwargs)" in inspect.getsource(gpu_worker.Worker.reload_weights)
    assert {"weights_iterator", "weights_path", "is_checkpoint_format"} <= set(
        inspect.signature(inplace.reload_weights).parameters)
    assert {"method", "args"} <= set(inspect.signature(LLM.collective_rpc).parameters)
    assert callable(LLM.reset_prefix_cache)
