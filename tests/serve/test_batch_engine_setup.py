"""serve/batch/engine_setup.py: what a running vLLM engine computes with, read back from a real engine.

The engine runs in a fresh interpreter started with rayline's engine environment, as the batch stage's engine
actor is (Ray sets a worker's environment before it starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import from_dict
from serve.online import engine as eng

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # starts a vLLM engine on CPU
@pytest.mark.timeout(600)
def test_effective_setup_reads_back_what_the_engine_runs_with(tiny_model_dir):
    cfg = from_dict(eng.EngineConfig, {"model": str(tiny_model_dir), "accelerator": "cpu", "max_model_len": 256,
                                       "max_num_seqs": 8, "dtype": "float32", "enforce_eager": True,
                                       "kv_cache_memory_bytes": 64 * eng.MiB, "max_num_batched_tokens": 768})
    script = "\n".join([
        "import asyncio, json",
        "from vllm import AsyncEngineArgs, AsyncLLMEngine",
        "from serve.online import engine as eng",
        "from serve.batch.engine_setup import effective_setup",
        "eng.apply_engine_core_start()",
        "async def main():",
        f"    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model={str(tiny_model_dir)!r}, "
        f"**{eng.vllm_engine_kwargs(cfg)!r}))",
        "    print('SETUP ' + json.dumps(effective_setup(engine)))",
        "    engine.shutdown()",
        "asyncio.run(main())",
    ])
    env = {**os.environ, **eng.runtime_env(cfg)["env_vars"], "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    setup = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("SETUP "))[len("SETUP "):])
    assert setup["EngineCore"] == "own process (AsyncMPClient)" and setup["EngineCore start"] == "fork", setup
    assert setup["executor"] == "UniProcExecutor", setup
    assert (setup["max_num_batched_tokens"], setup["max_num_seqs"], setup["max_model_len"]) == (768, 8, 256), setup
    assert setup["dtype"] == "float32" and setup["kv_cache_memory_bytes"] == 64 * eng.MiB, setup
    assert setup["stats logging"] == "LoggingStatLogger,PrometheusStatLogger", setup
    assert setup["OMP_NUM_THREADS"] == "1" and setup["front end torch threads"] == 1, setup
    assert setup["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and setup["VLLM_CPU_OMP_THREADS_BIND"] == "unset", setup
