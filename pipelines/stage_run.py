"""What every stage entry point does around its stage: run it, turn a config error into exit status 2 and a job that
could not get its resources into 1 (with the wait's report), print the stage's summary lines, and end with
`result: {...}`, the result as one JSON line for scripts (the demo, the tests)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from core.config import ConfigError
from core.resource_wait import ResourceWaitTimeout


def run_stage(name: str, stage: Callable[[], Any], summary: Callable[[Any], list[str]]) -> int:
    """Run `stage()`; print `summary(result)` and the result line. Returns the exit status."""
    try:
        result = stage()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ResourceWaitTimeout as e:
        print(f"{name} failed: {e}", file=sys.stderr)
        return 1
    for line in summary(result):
        print(line)
    print("result: " + json.dumps(asdict(result)))
    return 0


def losses(first: float | None, last: float | None) -> str:
    """`first -> last` with 4 decimals ("n/a" for one not measured)."""
    return " -> ".join(f"{x:.4f}" if x is not None else "n/a" for x in (first, last))


def model_line(result: Any) -> list[str]:
    """What the job used (core/usage.py) and the registered version's line, when the stage registered one."""
    used = getattr(result, "usage", None)
    return ([f"usage      {used.cpu_s:.1f} CPU-seconds, {used.gpu_s:.1f} GPU-seconds ({used.processes} processes)"]
            if used else []) + \
        ([f"model      models:/{result.model_name}/{result.model_version}"] if result.model_version else [])
