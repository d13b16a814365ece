"""Model FLOPs utilization: 6 x parameters x tokens/s (forward and backward of a dense decoder, attention
left out; ~4 x under LoRA, train_flops_per_token) over the peak FLOP/s of the devices that trained.

The peak is the datasheet's dense figure for known GPUs at the training dtype. A CPU has no such figure that
means anything for torch, so there the peak is what one torch thread of this machine reaches on a large
matmul in the training dtype, measured once per process: MFU on CPU says how close the loop comes to
the best this core does, not to a vendor number.
"""

from __future__ import annotations

import functools
import time

import torch

# Dense tensor-core peak FLOP/s per GPU (no sparsity), by a substring of torch.cuda.get_device_name().
GPU_PEAK_FLOPS = {
    torch.bfloat16: {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12},
    torch.float32: {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "L40S": 91.6e12, "L4": 30.3e12, "A10G": 31.2e12},
}


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    table = GPU_PEAK_FLOPS.get(dtype, {})
    return next((v for k, v in table.items() if k in name), None)


@functools.lru_cache(maxsize=4)
def measured_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of this process's torch on an n x n matmul (the loop's own thread count), best of a short run."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measured_peak_flops(dtype)
    return None


def parameter_count(model: torch.nn.Module) -> int:
    """All parameters of the model (FSDP2's DTensor parameters count their full shape)."""
    return sum(p.numel() for p in model.parameters())


def train_flops_per_token(model: torch.nn.Module) -> int:
    """2 N for the forward, 2 N for the backward's activation gradients, 2 N per trained weight for its gradient:
    6 N when every weight trains, ~4 N under LoRA (the frozen base gets no weight gradients)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 4 * parameter_count(model) + 2 * trained


def mfu(flops_per_token: int, tokens_per_s: float, world: int, peak: float | None) -> float | None:
    """Model FLOP/s (flops per token x tokens/s) over world x peak; None when the peak is unknown."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / (world * peak)
