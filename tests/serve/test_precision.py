"""serve/online/precision.py: `dtype: auto` follows the hardware, and the engine arguments carry the resolved dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_config
from serve.online import engine as eng
from serve.online.precision import cpu_bf16_flags, resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16\n"
X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.mark.parametrize(("cpuinfo", "dtype"), [(X86_BF16, "bfloat16"), (X86_AVX2, "float32"), (ARM_BF16, "bfloat16"),
                                                 ("", "float32")])
def test_auto_on_cpu_is_bf16_only_where_the_cpu_computes_it(cpuinfo, dtype):
    assert resolve_dtype("auto", "cpu", cpuinfo) == dtype


def test_a_named_dtype_and_gpu_auto_are_passed_as_given():
    assert resolve_dtype("float32", "cpu", X86_BF16) == "float32"
    assert resolve_dtype("bfloat16", "cpu", X86_AVX2) == "bfloat16"
    assert resolve_dtype("auto", "gpu", X86_AVX2) == "auto"  # vLLM's own: the GPU's 16-bit type


def test_flags_read_from_the_flags_line_only():
    assert cpu_bf16_flags("model name\t: bf16 in a name\nflags\t\t: avx2\n") == []
    assert cpu_bf16_flags(X86_BF16) == ["avx512_bf16", "amx_bf16"]


@pytest.mark.parametrize("path", ["configs/serve/tiny_cpu.yaml", "configs/batch/eval_tiny.yaml",
                                  "configs/batch/infer_tiny.yaml"])
def test_the_cpu_configs_threads_follow_the_engines_cpus(path):
    from serve.batch.config import Config as BatchConfig
    from serve.online.serve_config import Config as ServeConfig

    cfg = load_config(ServeConfig if "/serve/" in path else BatchConfig, ROOT / path, [])
    auto = load_config(ServeConfig if "/serve/" in path else BatchConfig, ROOT / path, ["engine.dtype=auto"])
    assert eng.vllm_engine_kwargs(auto.engine)["dtype"] == ("bfloat16" if cpu_bf16_flags() else "float32")
    # The compute threads follow the engine's CPUs (its whole CPUs, at least one), not a fixed count in the config.
    assert "OMP_NUM_THREADS" not in cfg.engine.env_vars
    threads = eng.runtime_env(cfg.engine)["env_vars"]["OMP_NUM_THREADS"]
    assert threads == str(max(1, int(cfg.engine.cpus_per_engine)))
