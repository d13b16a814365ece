"""Python's cyclic garbage collector paused: in per-record loops that make no reference cycles, and while a process
imports its heavy libraries.

A Serve replica, a batch or GRPO engine and a Train worker each begin by importing vLLM, torch and transformers:
millions of objects, and the collector's passes over them while they are being created are ~20% of the import's CPU
(vLLM's engine with Ray Serve LLM: ~11 -> ~8 CPU-seconds on the reference machine; torch + transformers + Ray Train:
~6 -> ~4.8). `heavy_imports` runs the imports with the collector off, then moves everything the process holds to the
permanent generation (`gc.freeze`), so later full collections skip the libraries' objects and a forked child (vLLM's
EngineCore on CPU) shares their pages. Before the interpreter exits they are handed back (`gc.unfreeze`), so its
shutdown frees them as it would have; garbage the imports made in cycles stays until then (kilobytes).
"""

from __future__ import annotations

import atexit
import gc
import importlib
from contextlib import contextmanager
from typing import Iterator

_unfreeze_at_exit = False


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The block runs with the cycle collector off (back on after it, if it was on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def heavy_imports() -> Iterator[None]:
    """The block's imports run with the collector off; what the process holds at its end is frozen (module doc)."""
    global _unfreeze_at_exit
    with no_cycle_collection():
        try:
            yield
        finally:
            gc.freeze()
            if not _unfreeze_at_exit:
                atexit.register(gc.unfreeze)
                _unfreeze_at_exit = True


def preload(*modules: str) -> None:
    """Import `modules` (dotted names) inside `heavy_imports`; a module already imported costs nothing."""
    with heavy_imports():
        for name in modules:
            importlib.import_module(name)
