"""serve/online/engine.py: how an engine actor starts vLLM's EngineCore (the rest of the engine config is covered by
the batch and serve tests that use it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.config import ConfigError, from_dict
from serve.online import engine as eng


def engine(**fields) -> eng.EngineConfig:
    return from_dict(eng.EngineConfig, {"model": "/m", **fields})


def test_engine_core_is_forked_on_cpu_and_spawned_on_gpu_unless_the_config_says():
    assert eng.runtime_env(engine())["env_vars"][eng.ENGINE_CORE_START_ENV] == "fork"
    assert eng.ENGINE_CORE_START_ENV not in eng.runtime_env(engine(engine_core_start="spawn"))["env_vars"]
    gpu = engine(accelerator="gpu", gpu_memory_utilization=0.8)
    assert eng.engine_core_start_method(gpu) == "spawn" and eng.runtime_env(gpu) == {}
    assert eng.runtime_env(engine(accelerator="gpu", engine_core_start="fork"))["env_vars"] == {
        eng.ENGINE_CORE_START_ENV: "fork"
    }
    with pytest.raises(ConfigError, match="engine_core_start"):
        engine(engine_core_start="forkserver")


PROBE = """
import os
from serve.online import engine as eng
from vllm.v1.engine import utils
for start in ("", "fork"):  # in this order: the fork replaces vLLM's lookup for the rest of the process
    if start:
        os.environ[eng.ENGINE_CORE_START_ENV] = start
    method = eng.apply_engine_core_start()
    print(method, utils.get_mp_context().get_start_method())
"""


@pytest.mark.slow  # imports vLLM (~20 s), once for both cases
def test_apply_engine_core_start_overrides_vllm_s_spawn_only_when_asked():
    pytest.importorskip("vllm")
    # vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn whatever the user had; the fork must win.
    base = {k: v for k, v in os.environ.items() if k != eng.ENGINE_CORE_START_ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-2:] == ["spawn spawn", "fork fork"]
