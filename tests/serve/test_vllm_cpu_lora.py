"""vLLM on CPU answers a request without an adapter with the base, also when it shares a batch with adapter
requests (serve/online/vllm_cpu_lora.py: vLLM 0.32's CPU ops gave such tokens the last adapter slot's weights).

Real vLLM on CPU, in a process of its own with vLLM's own EngineCore process (the plugin must reach it through
the installed entry point), the tiny model and a random adapter written by peft.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tests.serve.lora_adapters import write_adapter

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

base, adapter = sys.argv[1], sys.argv[2]
llm = LLM(model=base, enforce_eager=True, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
          enable_lora=True, max_lora_rank=8, max_loras=1, enable_prefix_caching=False)
prompts = [f"What is {a} + {b}?" for a, b in ((3, 4), (12, 5), (7, 9), (20, 1), (6, 6), (1, 8))]
sp = SamplingParams(max_tokens=8, temperature=0)
lora = LoRARequest("a", 1, adapter)
alone = [o.outputs[0].text for o in llm.generate(prompts, sp)]
with_adapter = [o.outputs[0].text for o in llm.generate(prompts, sp, lora_request=lora)]
mixed = [o.outputs[0].text for o in llm.generate(prompts + prompts, sp, lora_request=[lora] * len(prompts) + [None] * len(prompts))]
print("RESULT " + json.dumps({"alone": alone, "adapter": with_adapter, "mixed_adapter": mixed[:len(prompts)],
                              "mixed_base": mixed[len(prompts):]}))
"""


def test_the_fix_is_installed_as_a_vllm_plugin():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("rayline_cpu_lora") == "serve.online.vllm_cpu_lora:register", plugins


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_base_requests_batched_with_adapter_requests_are_answered_by_the_base(tiny_model_dir, tmp_path):
    adapter = write_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(adapter)], capture_output=True,
                         text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    differ = sum(a != b for a, b in zip(got["alone"], got["adapter"]))
    assert differ >= 4, got  # the adapter changes the answers, so answering with it would show
    assert got["mixed_base"] == got["alone"], got
    assert got["mixed_adapter"] == got["adapter"], got
