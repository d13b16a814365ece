"""data/heap.py: a worker that has applied `keep_freed_memory` reuses the large arrays it frees, where one with glibc's
defaults maps fresh pages (page faults) for every one. Each case runs in a process of its own: the setting is for the
whole process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Rounds of large numpy arrays as a shard task allocates them, all freed at the round's end. Prints each later round's
# minor page faults.
ROUNDS = """
import json, resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from data.heap import keep_freed_memory
    keep_freed_memory()
    keep_freed_memory()  # once per process: a second call changes nothing
def round_():
    a = np.full(16 << 20, 1, np.int32)  # 64 MiB
    b = np.concatenate([a, a])
    c = b.astype(np.int64)
    return int(c[-1])
round_()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def later_rounds(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: the setting applies on Linux only")
def test_freed_arrays_are_reused_instead_of_mapped_again():
    default, kept = later_rounds("default"), later_rounds("keep")
    # 448 MiB allocated a round: with the defaults every array is fresh pages in every round (at least one fault per
    # 2 MiB huge page, each page zeroed); kept, every round after the first reuses the memory the first freed.
    assert min(default) >= 150, default
    assert max(kept) < 10, (kept, default)
