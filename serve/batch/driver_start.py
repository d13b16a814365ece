"""The batch driver's start-up: what stands between `main()` and the engine actors' first second, made short.

Every second the driver spends before Ray Data starts executing is a second before the engine actors start
importing vLLM, the longest step of a batch job's start-up. The driver needs Ray's stage modules to build the
plan, and nothing of vLLM, torch or transformers' model code, so:
  - `without_vllm`: the plan is built with vLLM hidden (the engine actors import it, not the driver);
  - `torch_on_first_use`: Ray's stage module imports torch for the actors' code; the driver gets a stand-in
    that imports torch only if something uses it;
  - `config_json_as_autoconfig`: build_processor's telemetry read of the model's Hugging Face config is
    answered from config.json, without importing transformers' model modules;
  - `telemetry_reports_kept`: build_processor's telemetry report is kept for the engine actors to send once
    their engine is up, instead of a telemetry actor starting ahead of them;
  - `PlanWarmUp`: the stage imports run while the driver resolves the model, and Ray Data's singleton actors
    start as soon as Ray is up, before the plan needs them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def without_vllm():
    """Imports inside see vLLM as not installed, unless this process has imported it already.

    ray.data.llm builds its plan on a driver without vLLM (a CPU head node): its engine stage module imports
    vLLM only in a try block, for an exception class that the engine actors use, and every other use is
    inside the actors. rayline's driver has vLLM installed but never runs it, so it builds the plan with vLLM
    hidden: ~7 s less on 2 cores (vLLM's import) before the engine actors can start, and ~0.5 GB less on the
    driver. The actors import the stage afresh, with vLLM. A None in sys.modules makes `import vllm` raise
    ImportError; it is removed on the way out, so a later `import vllm` here works."""
    return _standing_in("vllm", None)


def config_json_as_autoconfig():
    """Inside, `transformers.AutoConfig.from_pretrained(path)` reads `path/config.json`, unless this process
    has imported transformers already.

    build_processor reads the model's Hugging Face config for one thing: the architecture name in Ray's usage
    telemetry report. That first AutoConfig read imports transformers and its model modules (~3 s on 2 cores)
    in a driver that never uses them, right before the engine actors can start. A stand-in `transformers`
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
    Importing torch for that costs ~1-2 s on 2 cores right before the engine actors can start, and ~300 MB
    in a driver that never computes. The stand-in answers `torch.hub._get_torch_home()` as torch does
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
def telemetry_reports_kept(reports: list):
    """Inside, ray.data.llm's usage-telemetry reports are appended to `reports` instead of being sent.

    build_processor creates a named telemetry actor and sends it a report (and waits for the reply). On a
    fresh cluster that actor is one more worker process, and a node starts as many worker processes at once
    as it has CPUs: created while the plan is built, it starts ahead of the engine actors. The engine actors
    send the kept reports once their engine is up (serve/batch/engine_stage.py, `send_telemetry`), to the
    same actor (created then, get_if_exists), where Ray records them as usage tags."""
    from ray.llm._internal.batch.processor import vllm_engine_proc

    create = vllm_engine_proc.get_or_create_telemetry_agent
    vllm_engine_proc.get_or_create_telemetry_agent = lambda: _KeptReports(reports)
    try:
        yield reports
    finally:
        vllm_engine_proc.get_or_create_telemetry_agent = create


class _KeptReports:
    def __init__(self, reports: list):
        self.reports = reports

    def push_telemetry_report(self, telemetry) -> None:
        self.reports.append(telemetry)


def send_telemetry(reports: list) -> None:
    """Send kept telemetry reports to ray.data.llm's telemetry actor without waiting for it; like Ray's own
    push, a failure is logged by Ray or ignored, never raised."""
    if not reports:
        return
    from ray.llm._internal.batch.observability.usage_telemetry.usage import get_or_create_telemetry_agent

    agent = get_or_create_telemetry_agent().remote_telemetry_agent
    if agent is None:  # Ray could not create it (and logged why)
        return
    for report in reports:
        _quietly(agent.record.remote, report)


class PlanWarmUp:
    """What building and starting the plan wait for, begun while the driver resolves the model and connects
    to Ray.

    On one thread: the engine stage's imports (Ray's stage modules, vLLM hidden, torch on first use; ~0.8 s on
    2 cores). Once Ray is up (`start_cluster_actors`): the named actors that Ray Data's executor would create
    (get_if_exists) at its start: its stats actor (the driver waits on it for the dataset id), actor location
    tracker and autoscaling coordinator. On a fresh cluster each is a new worker process importing Ray Data
    (~1 s of CPU), and a node starts only as many worker processes at once as it has CPUs: created here, they
    start beside the driver's imports instead of in the same queue as the engine actors. On a long-running
    cluster they exist already (they are detached) and this finds them."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rayline-plan-warm-up")
        self._thread.submit(_quietly, _import_engine_stage)

    def start_cluster_actors(self) -> None:
        _quietly(_create_cluster_actors)

    def wait(self) -> None:
        self._thread.shutdown(wait=True)


def _quietly(fn, *args) -> None:
    """Warm-up only: building and running the plan does the same work again and raises with its own traceback."""
    try:
        fn(*args)
    except Exception:
        pass


def _import_engine_stage() -> None:
    with without_vllm(), torch_on_first_use():
        import ray.data.llm  # noqa: F401
        from ray.llm._internal.batch.processor import vllm_engine_proc  # noqa: F401

        import serve.batch.engine_stage  # noqa: F401


def _create_cluster_actors() -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )
    from ray.data._internal.execution.node_trackers.actor_location import get_or_create_actor_location_tracker
    from ray.data._internal.stats import get_or_create_stats_actor

    get_or_create_stats_actor()  # first: the one the driver waits on
    get_or_create_actor_location_tracker()
    get_or_create_autoscaling_coordinator()
