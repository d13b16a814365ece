"""What a running vLLM engine computes with, read back from the engine and its process (not from the config
that was passed in): the batch stage's engine actors print it once their engine is up, and
bench/bench_batch_infer.py reads plain vLLM's the same way, so the two sides' set-ups can be compared.

Kept apart from engine_stage.py, which imports Ray's stage: reading a plain vLLM engine needs neither Ray nor
rayline's stage.
"""

from __future__ import annotations

import os
from typing import Any

THREAD_ENV = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")
"""Environment that decides how many compute threads the engine runs and how vLLM lays out its processes."""
SETUP_LINE = "rayline engine set-up: "
"""What the engine actors' line starts with (the JSON of effective_setup follows)."""


def effective_setup(engine: Any) -> dict[str, Any]:
    """A vLLM AsyncLLM or LLMEngine (`LLM.llm_engine`) -> a flat dict of what it runs with: where EngineCore runs
    and how it was started, the executor, the scheduler's batch limits, the model's dtype and context, the KV
    cache and stats logging, plus this (front-end) process's id, niceness, torch threads and the environment
    EngineCore inherits (THREAD_ENV)."""
    import torch
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import Executor

    cfg = engine.vllm_config
    client = type(engine.engine_core).__name__
    in_process = client == "InprocClient"
    return {
        "front end pid": os.getpid(),
        "EngineCore": f"in the front end ({client})" if in_process else f"own process ({client})",
        "EngineCore start": "-" if in_process else engine_utils.get_mp_context().get_start_method(),
        "executor": Executor.get_class(cfg).__name__,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_model_len": cfg.model_config.max_model_len,
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "enforce_eager": cfg.model_config.enforce_eager,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "stats logging": stat_loggers(engine),
        "front end niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "front end torch threads": torch.get_num_threads(),
        # EngineCore starts with the front end's environment (forked or spawned); read here because a process
        # that sets its title (EngineCore, a Ray worker) overwrites what /proc shows of its environment.
        **{name: os.environ.get(name, "unset") for name in THREAD_ENV},
    }


def stat_loggers(engine: Any) -> str:
    """`off`, or the engine's stat loggers by class (a per-engine adapter by the logger it wraps)."""
    manager = getattr(engine, "logger_manager", None)
    if not engine.log_stats or manager is None:
        return "off"
    names = []
    for logger in manager.stat_loggers:
        inner = getattr(logger, "per_engine_stat_loggers", None)
        names += sorted({type(x).__name__ for x in inner.values()}) if inner else [type(logger).__name__]
    return ",".join(names)
