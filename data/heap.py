"""How the stage's worker processes use memory: they keep what they free for their next allocation instead of
handing it back (their per-record loops run without Python's cycle collector: core/collector.py).

A shard task allocates a few hundred MB of large numpy arrays (token ids, labels, packed rows) and frees them at its
end. By default glibc maps each large array afresh (mmap) and unmaps it when freed, so the next arrays meet fresh
pages: 0.3-0.4 s of kernel time per 25,000 records on this machine, about a third of what a shard task spends beside
the tokenizer. With glibc's mmap and trim thresholds raised, freed arrays stay in the heap and the next ones reuse
them. Arrow's buffers stay on Arrow's default pool (mimalloc), which already reuses what it frees: moved onto glibc,
Arrow's aligned, growing buffers faulted fresh pages in every other round of a test loop, and a stage run was no
faster (2026-12-05).

The cost is memory held between tasks: a worker keeps about its largest task's peak until its job ends (the data
stage's workers end with its job); `bench/bench_scale.py` saw the cluster's peak PSS 12% higher at 200,000 records
and 1.5% at 2M (2026-12-05).
Applied once per process, on Linux only; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_applied = False


def keep_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds, once per process."""
    global _applied
    if _applied or not sys.platform.startswith("linux"):
        return
    _applied = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # 1 GiB: past any one array of a shard; a glibc that caps the threshold lower (32 MiB) takes its cap.
        if not libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30):
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): keep the defaults
        pass
