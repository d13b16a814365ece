"""core/collector.py: the collector is off inside the blocks and back on after; heavy imports leave the process's
objects frozen and hand them back at exit."""

from __future__ import annotations

import gc
import subprocess
import sys

from core.collector import no_cycle_collection


def test_no_cycle_collection_pauses_and_restores_the_collector():
    assert gc.isenabled()
    with no_cycle_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with no_cycle_collection():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_heavy_imports_freeze_what_the_process_holds_and_unfreeze_it_at_exit():
    # In a fresh interpreter: freezing this pytest process would keep its objects from ever being collected.
    code = """
import atexit, gc, sys
from core.collector import heavy_imports, preload
assert gc.get_freeze_count() == 0
atexit.register(lambda: print("frozen at the end", gc.get_freeze_count()))  # atexit runs last-in first-out
with heavy_imports():
    assert not gc.isenabled()
    import json
frozen = gc.get_freeze_count()
assert gc.isenabled() and frozen > 1000, frozen
preload("email.parser")
assert "email.parser" in sys.modules and gc.get_freeze_count() > frozen
atexit.register(lambda: print("frozen at exit", gc.get_freeze_count()))  # before heavy_imports' unfreeze
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ok" and lines[1].startswith("frozen at exit ") and lines[1] != "frozen at exit 0", lines
    assert lines[2] == "frozen at the end 0", lines  # unfrozen for the interpreter's own shutdown
