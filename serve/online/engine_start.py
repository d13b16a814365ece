"""The engine replicas' LLMConfig and what runs in a replica before its engine starts.

    build_llm_config(cfg, model, base_env)   Ray Serve LLM's LLMConfig of the replicas serving `model`
    EngineStartCallback                      the replica's hook before its engine starts (executor, EngineCore
                                             start method, vLLM's logging, no download of a local checkpoint)

Imports ray.serve.llm, so vLLM: used by the builder (serve/online/app.py `build_app`) and the replicas
(serve/online/llm_hooks.py), never by rendering a serve config.
"""

from __future__ import annotations

from ray.llm._internal.common.callbacks.base import CallbackBase

from core import storage
from serve.online import engine
from serve.online.engine import apply_engine_core_start
from serve.online.serve_config import Config
from serve.online.served_model import ServedModel, replica_env_vars


def keep_requested_executor_backend() -> None:
    """Make Ray Serve LLM pass on the `distributed_executor_backend` the engine kwargs ask for.

    On CPU Ray replaces it with `mp` whatever the kwargs say (on GPU it requires `ray` and says so); rayline's
    CPU engine asks for `uni` (serve.online.engine.vllm_engine_kwargs). Patches Ray's engine-config class in this
    process (the replica), once; a request for anything else on GPU still gets Ray's own error."""
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    original = VLLMEngineConfig.get_initialization_kwargs
    if getattr(original, "rayline", False):
        return

    def get_initialization_kwargs(self) -> dict:
        kwargs = original(self)
        requested = self.engine_kwargs.get("distributed_executor_backend")
        if requested:
            kwargs["distributed_executor_backend"] = requested
        return kwargs

    get_initialization_kwargs.rayline = True
    VLLMEngineConfig.get_initialization_kwargs = get_initialization_kwargs


def vllm_logs_to_stderr() -> None:
    """vLLM's INFO lines to the replica's stderr through one plain handler, where VLLM_CONFIGURE_LOGGING=0 (
    REPLICA_LOGGING_ENV, serve/online/served_model.py) kept vLLM from configuring logging itself (and closing Serve's handlers)."""
    import logging
    import sys

    log = logging.getLogger("vllm")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class EngineStartCallback(CallbackBase):
    """Runs in the replica before its engine starts: the executor the engine kwargs ask for (`uni` on CPU),
    rayline's EngineCore start method (serve.online.engine: fork on CPU), and with `local_checkpoint` (a directory
    every node already sees) no per-node download tasks."""

    async def on_before_node_init(self) -> None:
        vllm_logs_to_stderr()
        keep_requested_executor_backend()
        apply_engine_core_start()
        if self.kwargs.get("local_checkpoint"):
            self.ctx.run_init_node = False


def build_llm_config(cfg: Config, model: ServedModel, base_env: dict[str, str]):
    """Ray Serve LLM's LLMConfig of the engine replicas serving `model` (imports ray.serve.llm, so vLLM)."""
    from ray.serve.llm import LLMConfig

    engine_kwargs = {
        **cfg.lora.engine_kwargs(),
        **engine.vllm_engine_kwargs(cfg.engine),
        # vLLM frontend options (Ray routes them to the OpenAI layer): stamp the version on responses.
        "fingerprint_mode": "custom",
        "fingerprint_value": model.label,
    }
    # LLMConfig.runtime_env replaces the app's env_vars wholesale, so carry the app's own along.
    env_vars = replica_env_vars(cfg, model, base_env)
    experimental = {}
    if cfg.stream_batching_interval_ms is not None:
        experimental["stream_batching_interval_ms"] = cfg.stream_batching_interval_ms
    # A checkpoint already on this filesystem: skip Ray's per-node download tasks (tens of seconds).
    callback = {"local_checkpoint": not storage.is_remote(model.source)}
    return LLMConfig(
        model_loading_config={"model_id": cfg.served_model_id, "model_source": model.source},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": cfg.engine.accelerator},
        accelerator_type=cfg.engine.accelerator_type,
        placement_group_config=engine.placement_group_config(cfg.engine),
        runtime_env={"env_vars": env_vars},
        experimental_configs=experimental,
        log_engine_metrics=cfg.log_engine_metrics,
        deployment_config={
            "autoscaling_config": cfg.autoscaling.to_serve(),
            "max_ongoing_requests": cfg.max_ongoing_requests,
            "max_surge_percent": cfg.max_surge_percent,
            "health_check_period_s": cfg.health_check_period_s,
            "health_check_timeout_s": cfg.health_check_timeout_s,
            "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
            **cfg.routing.to_serve(),  # the engine replicas' request router (serve/online/routing_config.py)
            # The replica actor adds nothing to the engine's bundle: the engine's CPUs are the replica's.
            "ray_actor_options": {"num_cpus": 0},
            # One selector: Serve applies it to every bundle of the replica's placement group.
            **({"placement_group_bundle_label_selector": [dict(cfg.node_labels)]} if cfg.node_labels else {}),
        },
        callback_config={"callback_class": EngineStartCallback, "callback_kwargs": callback},
    )
