"""data/heap.py: a worker that has applied `keep_freed_memory` reuses the memory it frees, where one with glibc's and
Arrow's defaults maps fresh pages (page faults) for every large array. Each case runs in a process of its own: the
setting is for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Rounds of what a shard task allocates: large numpy arrays and an Arrow buffer, all freed at the round's end. Prints
# the third round's minor page faults (Arrow's aligned buffers settle in the kept heap by then) and Arrow's pool.
ROUNDS = """
import json, resource, sys
import numpy as np, pyarrow as pa
if sys.argv[1] == "keep":
    from data.heap import keep_freed_memory
    keep_freed_memory()
    keep_freed_memory()  # once per process: a second call changes nothing
def round_():
    a = np.full(16 << 20, 1, np.int32)  # 64 MiB
    b = np.concatenate([a, a])
    c = pa.array(a).cast(pa.int64())
    return int(b[-1]) + c[0].as_py()
round_()
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "pool": pa.default_memory_pool().backend_name}))
"""


def third_round(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: the setting applies on Linux only")
def test_freed_arrays_are_reused_instead_of_mapped_again():
    default, kept = third_round("default"), third_round("keep")
    # 320 MiB allocated in the round: with the defaults every array is fresh pages (at least one fault per 2 MiB huge
    # page, each page zeroed); kept, the round reuses the earlier rounds' memory.
    assert default["faults"] >= 150, default
    assert kept["faults"] < 10, (kept, default)
    assert kept["pool"] == "system" and default["pool"] != "system"
