"""The batch driver builds the plan without importing vLLM, torch or transformers' model code.

Ray's stage modules, which build_processor imports to build the plan, import vLLM and torch at their top for
code that runs only in the engine actors, and build_processor reads the model's Hugging Face config for its
usage telemetry. Imported in the driver, vLLM, torch and transformers' model modules cost seconds of both
cores right before the engine actors can start, and memory on a driver that never computes. So the plan is
built inside `plan_without_engine_imports`: vLLM hidden, torch imported only if something uses it, and the
model's config answered from its config.json; the engine actors import all three afresh.

What it is worth (bench/bench_batch_infer.py --part rayline on 64 prompts, d05bce8's driver with its start-up
tricks toggled, runs in rotating order, 2026-12-01, 2-core box): the first request reached the engine 40.3 s
after the driver's first import with the three (six runs, 38.2-45.6 s) against 49.4 s without (nine runs,
41.1-60.1 s): ~9 s, about 3% of the bench's default job end to end (~300 s). Each pays only with the others
(vLLM hidden alone: 45.9 s, three runs), since vLLM's import is mostly torch's and transformers'. These are
stand-in modules in sys.modules, not a Ray or vLLM setting: recheck them on each Ray or vLLM upgrade
(tests/serve/test_batch_driver_start.py).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import types
from pathlib import Path


def without_vllm():
    """Imports inside see vLLM as not installed, unless this process has imported it already.

    ray.data.llm builds its plan on a driver without vLLM (a CPU head node): its engine stage module imports
    vLLM only in a try block, for an exception class that the engine actors use, and every other use is
    inside the actors. rayline's driver has vLLM installed but never runs it, so it builds the plan with vLLM
    hidden. The actors import the stage afresh, with vLLM. A None in sys.modules makes `import vllm` raise
    ImportError; it is removed on the way out, so a later `import vllm` here works."""
    return _standing_in("vllm", None)


def config_json_as_autoconfig():
    """Inside, `transformers.AutoConfig.from_pretrained(path)` reads `path/config.json`, unless this process
    has imported transformers already.

    build_processor reads the model's Hugging Face config for one thing: the architecture name in Ray's usage
    telemetry report. That first AutoConfig read imports transformers and its model modules in a driver that
    never uses them, right before the engine actors can start. A stand-in `transformers`
    module answers it from config.json (the same fields AutoConfig reads, as attributes). Anything else asked
    of the stand-in, and any model without a local config.json (a Hugging Face id), gets the real package,
    imported then. The stand-in leaves sys.modules on the way out."""
    return _standing_in("transformers", _ConfigJsonTransformers("transformers"))


@contextlib.contextmanager
def _standing_in(name: str, stand_in: types.ModuleType | None):
    """Inside, `stand_in` is sys.modules[name] (None: the module reads as not installed), unless this process
    has imported `name` already. On the way out it leaves sys.modules, unless the real module replaced it."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is stand_in:
            del sys.modules[name]


class _StandIn(types.ModuleType):
    """A stand-in module: what it does not define itself comes from the real module, imported then."""

    def __getattr__(self, name: str):
        return getattr(_real(self.__name__), name)


def _real(name: str) -> types.ModuleType:
    """The installed module `name`, replacing a stand-in in sys.modules."""
    if isinstance(sys.modules.get(name), _StandIn):
        del sys.modules[name]
    return importlib.import_module(name)


class _ConfigJsonAutoConfig:
    @staticmethod
    def from_pretrained(model: str, *args, **kwargs):
        path = Path(str(model)) / "config.json"
        if path.is_file():
            return types.SimpleNamespace(**json.loads(path.read_text()))
        return _real("transformers").AutoConfig.from_pretrained(model, *args, **kwargs)


class _ConfigJsonTransformers(_StandIn):
    """The stand-in of config_json_as_autoconfig: AutoConfig from config.json, the real package for the rest."""

    AutoConfig = _ConfigJsonAutoConfig


def torch_on_first_use():
    """Inside, `import torch` gives a stand-in that imports torch when anything of it is used, unless this
    process has imported torch already.

    Ray's engine stage module imports torch at its top for code that runs only in the engine actors, and
    build_processor asks `torch.hub` for torch's cache directory (to create a kernels directory in it).
    Importing torch for that costs seconds right before the engine actors can start, in a driver that never
    computes. The stand-in answers `torch.hub._get_torch_home()` as torch does
    (TORCH_HOME, else $XDG_CACHE_HOME/torch, else ~/.cache/torch); anything else imports the real torch then
    and answers from it, so code that does use torch gets torch. Modules imported inside keep the stand-in as
    their `torch`; it leaves sys.modules on the way out."""
    return _standing_in("torch", _TorchOnFirstUse("torch"))


class _TorchHub:
    @staticmethod
    def _get_torch_home() -> str:
        default = os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "torch")
        return os.path.expanduser(os.getenv("TORCH_HOME", default))

    def __getattr__(self, name: str):
        return getattr(_real("torch").hub, name)


class _TorchOnFirstUse(_StandIn):
    """The stand-in of torch_on_first_use: torch.hub's home directory, the real torch for the rest."""

    hub = _TorchHub()


@contextlib.contextmanager
def plan_without_engine_imports():
    """Inside: vLLM hidden, torch on first use and the model config from config.json (see the module
    docstring); each leaves sys.modules on the way out."""
    with without_vllm(), torch_on_first_use(), config_json_as_autoconfig():
        yield
