"""The batch driver's start-up: what stands between `main()` and the engine actors' first second, made short.

Every second the driver spends before Ray Data starts executing is a second before the engine actors start
importing vLLM, the longest step of a batch job's start-up. The driver needs Ray's stage modules to build the
plan, and nothing of vLLM or transformers' model code, so:
  - `without_vllm`: the plan is built with vLLM hidden (the engine actors import it, not the driver);
  - `config_json_as_autoconfig`: build_processor's telemetry read of the model's Hugging Face config is
    answered from config.json, without importing transformers' model modules;
  - `PlanWarmUp`: the stage imports run while the driver resolves the model, and the cluster's singleton
    actors (Ray Data's and ray.data.llm's) start as soon as Ray is up, before the plan needs them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
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


def _real_transformers() -> types.ModuleType:
    """The installed transformers package, replacing the stand-in in sys.modules."""
    if isinstance(sys.modules.get("transformers"), _ConfigJsonTransformers):
        del sys.modules["transformers"]
    return importlib.import_module("transformers")


class _ConfigJsonAutoConfig:
    @staticmethod
    def from_pretrained(model: str, *args, **kwargs):
        path = Path(str(model)) / "config.json"
        if path.is_file():
            return types.SimpleNamespace(**json.loads(path.read_text()))
        return _real_transformers().AutoConfig.from_pretrained(model, *args, **kwargs)


class _ConfigJsonTransformers(types.ModuleType):
    """The stand-in of config_json_as_autoconfig: AutoConfig from config.json, the real package for the rest."""

    AutoConfig = _ConfigJsonAutoConfig

    def __getattr__(self, name: str):
        return getattr(_real_transformers(), name)


@contextlib.contextmanager
def telemetry_report_in_background():
    """Inside, ray.data.llm's usage-telemetry report is sent without waiting for the reply.

    build_processor sends its report to a named actor and waits for it (ray.get). On a cluster where no batch
    job ran yet in this driver, that actor is a worker process still starting (1-3 s on 2 cores, beside the
    driver's imports), and the plan, so the engine actors, wait for it. Sent as a plain remote call, the
    report is recorded once the actor is up; like Ray's own push, a failure never stops the plan."""
    from ray.llm._internal.batch.observability.usage_telemetry.usage import TelemetryAgent

    push = TelemetryAgent.push_telemetry_report

    def push_in_background(self, telemetry) -> None:
        if self.remote_telemetry_agent is not None:
            _quietly(self.remote_telemetry_agent.record.remote, telemetry)

    TelemetryAgent.push_telemetry_report = push_in_background
    try:
        yield
    finally:
        TelemetryAgent.push_telemetry_report = push


class PlanWarmUp:
    """What building and starting the plan wait for, begun while the driver resolves the model and connects
    to Ray.

    On one thread: the engine stage's imports (torch and Ray's stage modules, vLLM hidden; ~1.5 s on 2 cores).
    Once Ray is up (`start_cluster_actors`): the named actors that the plan and Ray Data's executor would
    create (get_if_exists) at its start: Ray Data's stats actor (the driver waits on it for the dataset id),
    ray.data.llm's telemetry agent, Ray Data's actor location tracker and autoscaling coordinator. On a fresh
    cluster each is a new worker process importing Ray Data (~1 s of CPU), and a node starts only as many
    worker processes at once as it has CPUs: created here, they start beside the driver's imports instead of
    in the same queue as the engine actors. On a long-running cluster Ray Data's three exist already (they
    are detached) and this finds them."""

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
    with without_vllm():
        import ray.data.llm  # noqa: F401
        from ray.llm._internal.batch.processor import vllm_engine_proc  # noqa: F401

        import serve.batch.engine_stage  # noqa: F401


def _create_cluster_actors() -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )
    from ray.data._internal.execution.node_trackers.actor_location import get_or_create_actor_location_tracker
    from ray.data._internal.stats import get_or_create_stats_actor
    from ray.llm._internal.batch.observability.usage_telemetry.usage import get_or_create_telemetry_agent

    get_or_create_stats_actor()  # first: the one the driver waits on
    get_or_create_telemetry_agent()
    get_or_create_actor_location_tracker()
    get_or_create_autoscaling_coordinator()
