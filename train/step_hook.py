"""An optional callable every training rank runs after each optimizer step, named by the environment.

`RAYLINE_STEP_HOOK=module:function` (with `RAYLINE_STEP_HOOK_ARGS`, a JSON object of keyword arguments) makes each
worker call `function(step, rank, world_size, **args)` after every optimizer step. The tests install their fault
injector through it (tests/train/fault_injector.py); nothing in rayline sets it. The trainer forwards both variables
to its workers (train/trainer.py FORWARDED_ENV).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable

STEP_HOOK_ENV = "RAYLINE_STEP_HOOK"
STEP_HOOK_ARGS_ENV = "RAYLINE_STEP_HOOK_ARGS"
STEP_HOOK_ENV_VARS = (STEP_HOOK_ENV, STEP_HOOK_ARGS_ENV)


def load_step_hook(rank: int, world_size: int) -> Callable[[int], None] | None:
    """The hook `RAYLINE_STEP_HOOK` names, bound to this rank (None when unset); a ValueError names a bad value."""
    spec = os.environ.get(STEP_HOOK_ENV, "")
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{STEP_HOOK_ENV}={spec!r}: expected module:function")
    try:
        args = json.loads(os.environ.get(STEP_HOOK_ARGS_ENV) or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"{STEP_HOOK_ARGS_ENV}: not JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{STEP_HOOK_ARGS_ENV}: expected a JSON object of keyword arguments, got {type(args).__name__}")
    fn = getattr(importlib.import_module(module), name)
    return lambda step: fn(step, rank, world_size, **args)
