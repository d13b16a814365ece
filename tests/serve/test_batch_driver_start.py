"""The batch driver's start-up (serve/batch/driver_start.py): the plan is built without vLLM, torch or
transformers' model code.

The checks run in a fresh interpreter, as a job's driver is: the test process has imported vLLM and
transformers already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve.online import engine as eng

ROOT = Path(__file__).resolve().parents[2]


def run_python(*lines: str) -> str:
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # the actors' imports run in the test stack's Ray; the driver's in a fresh interpreter
def test_the_driver_builds_the_plan_without_vllm_torch_or_transformers_model_code(local_stack, tiny_model_dir):
    cfg = {"input_uri": "p.jsonl", "output_uri": "out", "num_engines": 1,
           "engine": {"model": str(tiny_model_dir), "accelerator": "cpu", "max_model_len": 256,
                      "kv_cache_memory_bytes": 64 * eng.MiB}}
    out = run_python(
        "import sys",
        "from core.config import from_dict",
        "from core.ray_cluster import init_ray",
        "from serve.batch.config import Config",
        "from serve.batch.pipeline import engine_processor",
        "init_ray()",
        f"processor = engine_processor(from_dict(Config, {cfg!r}), {str(tiny_model_dir)!r})",
        "print('stage:', processor.get_stage_by_name('vLLMEngineStage').fn.__name__)",
        "print('vllm:', sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))",
        "print('transformers models:', sorted(m for m in sys.modules if m.startswith('transformers.models')))",
        "print('torch:', sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))",
        "import vllm.sampling_params  # hidden only while the plan is built",
        "print('then:', vllm.sampling_params.RequestOutputKind.FINAL_ONLY.name)",
        "import ray.llm._internal.batch.stages.vllm_engine_stage as stage  # its `torch` is the stand-in",
        "print('torch on first use:', stage.torch.bfloat16 is sys.modules['torch'].bfloat16)",
    )
    assert "stage: EngineStageUDF" in out, out
    assert "vllm: []" in out and "transformers models: []" in out and "torch: []" in out, out
    assert "then: FINAL_ONLY" in out, out
    assert "torch on first use: True" in out, out


def test_autoconfig_stand_in_reads_config_json_and_leaves_the_rest_to_transformers(tiny_model_dir, tmp_path):
    expected = json.loads((tiny_model_dir / "config.json").read_text())
    out = run_python(
        "import sys",
        "from serve.batch.driver_start import config_json_as_autoconfig",
        "with config_json_as_autoconfig():",
        "    import transformers",
        f"    c = transformers.AutoConfig.from_pretrained({str(tiny_model_dir)!r}, trust_remote_code=False)",
        "    print('config:', c.architectures, c.model_type, c.max_position_embeddings)",
        "    print('model modules:', sorted(m for m in sys.modules if m.startswith('transformers.models')))",
        "print('after the block:', 'transformers' in sys.modules)",
        "with config_json_as_autoconfig():",
        "    import transformers",
        "    print('other names:', transformers.__version__ == __import__('importlib.metadata').metadata.version('transformers'))",
        "    try:",
        f"        transformers.AutoConfig.from_pretrained({str(tmp_path / 'no-config-here')!r})",
        "    except OSError as e:",
        "        print('no config.json: real AutoConfig:', type(e).__name__)",
        "print('after the second:', type(sys.modules['transformers']).__name__)",
    )
    assert f"config: {expected['architectures']} {expected['model_type']} {expected['max_position_embeddings']}" in out
    assert "model modules: []" in out and "after the block: False" in out, out
    assert "other names: True" in out and "no config.json: real AutoConfig: OSError" in out, out
    # Once the real package was imported it stays: the stand-in never outlives the block.
    assert "after the second: _LazyModule" in out, out


def test_torch_stand_in_answers_torch_home_and_imports_torch_for_anything_else(tmp_path):
    out = run_python(
        "import os, sys",
        f"os.environ['TORCH_HOME'] = {str(tmp_path / 'th')!r}",
        "from serve.batch.driver_start import torch_on_first_use",
        "with torch_on_first_use():",
        "    import torch",
        "    print('home:', torch.hub._get_torch_home())",
        "    print('imported:', 'torch._C' in sys.modules)",
        "    print('tensor:', torch.tensor([1, 2]).sum().item())",
        "    print('real after use:', type(sys.modules['torch']).__name__)",
        "print('after the block:', type(sys.modules['torch']).__name__)",
        "with torch_on_first_use():",
        "    import torch.hub as hub",
        "    print('submodule:', hub.__name__, type(sys.modules['torch']).__name__)",
    )
    assert f"home: {tmp_path / 'th'}" in out and "imported: False" in out, out
    assert "tensor: 3" in out and "real after use: module" in out and "after the block: module" in out, out
    assert "submodule: torch.hub module" in out, out
