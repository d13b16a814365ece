"""The engine's precision: `dtype: auto` follows the hardware.

vLLM resolves `auto` on any x86 CPU to bfloat16, where only a CPU with AVX-512 BF16 (or AMX) computes it fast: on
the AVX2-only CPU of 2026-12-01 one thread's GEMM at 128 x 512 x 1408 ran 72.7 GFLOP/s in float32 against 8.0 in
bfloat16, and on the AVX-512 BF16 CPU of 2026-12-06, 93-98 against 210 (bench/bench_batch_infer.py). So on CPU
`auto` is bfloat16 where the CPU has those instructions and float32 elsewhere; on GPU it stays vLLM's `auto` (the
checkpoint's 16-bit type, bfloat16 for a float32 checkpoint on a GPU that has it).

    resolve_dtype("auto", "cpu")    # "bfloat16" on an AVX-512 BF16 / AMX CPU, "float32" on others
    cpu_bf16_flags()                # the CPU flags that made it so, read from /proc/cpuinfo
"""

from __future__ import annotations

from pathlib import Path

# x86: AVX-512 BF16 or AMX BF16; aarch64: the BF16 extension (its `Features` line names it `bf16`).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The BF16_FLAGS this machine's CPU reports (`cpuinfo`: /proc/cpuinfo's text, read when None; none off Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return [f for f in BF16_FLAGS if f in flags]


def resolve_dtype(dtype: str, accelerator: str, cpuinfo: str | None = None) -> str:
    """The dtype the engine is given: `dtype` itself unless it is `auto`; `auto` on CPU is bfloat16 when the CPU
    computes it natively (cpu_bf16_flags) and float32 otherwise; on GPU vLLM resolves `auto` itself."""
    if dtype != "auto" or accelerator != "cpu":
        return dtype
    return "bfloat16" if cpu_bf16_flags(cpuinfo) else "float32"
