"""The Ray Serve LLM application built from the serving `Config`, and the same app as a `serve deploy` config.

    render_serve_config(cfg, model)   -> {"http_options": ..., "applications": [{name, route_prefix, import_path, args}]}
    build_app(args)                   -> the Serve Application (`import_path: serve.online.app:build_app`)

The rendered dict is what `serve deploy` reads, what the dashboard's `PUT /api/serve/applications/`
takes and what a RayService carries as `serveConfigV2`. Its `args` hold the whole serving config and
the model version it was pinned to, so the builder needs nothing else.

Which version answers: every non-streamed response and the last chunk of a stream carry
`system_fingerprint = "<registered name>/<version>"` (vLLM's custom fingerprint, set per engine, so it
names the replica that actually answered), and `GET /v1/models` lists the model with
`metadata.rayline = {name, version, alias, ref, label}` (registry names, never a storage path).

Every route but the liveness probes needs an API key (serve/online/api_auth.py, the serving config's `auth`), checked by the
replicas that serve the routes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core import metrics, registry, storage
from core.config import from_dict, to_dict
from serve.online import engine
from serve.online.serve_config import Config

BUILDER = "serve.online.app:build_app"


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint a deployment loads and the registry version it is."""

    source: str
    """What the replicas load: a local checkpoint directory, or an s3:// URI each node downloads."""
    ref: str
    """The pinned reference (`models:/name/N`), or the path/URI itself."""
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    """The alias that selected this version, when one did."""
    digest: str | None = None
    """sha256 digest of the files the gate approved (core/weights_manifest.py): each replica loads nothing else."""

    @property
    def label(self) -> str:
        """What responses report as the serving version: `name/N`, else the reference."""
        return f"{self.name}/{self.version}" if self.name and self.version else self.ref

    def to_args(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_args(cls, data: dict[str, Any]) -> "ServedModel":
        return cls(**{k: data.get(k) for k in ("source", "ref", "name", "version", "alias", "digest")})


def resolve_served_model(ref: str, cache_dir: str | Path | None = None, alias: str | None = None) -> ServedModel:
    """A model reference -> the checkpoint to serve, pinned to one registry version.

    s3:// checkpoints stay URIs (every replica node downloads them itself); anything else becomes a
    local directory through `serve.online.engine.resolve_model` (MLflow artifacts are downloaded into cache_dir). Either
    way the bytes are hashed against the version's manifest here, and the digest is pinned for the replicas.
    """
    cache = cache_dir or engine.default_cache_dir()
    uri = registry.resolve_model_uri(ref, cache)
    if storage.is_s3(uri):
        name = version = mv = None
        if ref.startswith("models:/"):
            mv = registry.get_version(ref)
            name, version = mv.name, str(mv.version)
            alias = alias or registry.parse_model_ref(ref)[2]
        source, info = uri, engine.ModelInfo(ref=ref, uri=uri, name=name, version=version, alias=alias,
                                             digest=engine.checked_digest(uri, mv))
    else:
        source, info = engine.resolve_model(ref, cache)
    pinned = f"models:/{info.name}/{info.version}" if info.name and info.version else ref
    return ServedModel(source=source, ref=pinned, name=info.name, version=info.version, alias=alias or info.alias,
                       digest=info.digest)


def resolve_served_adapters(cfg: Config, model: ServedModel) -> dict[str, dict[str, Any]]:
    """cfg.lora.adapters, each pinned to one version and checked against the served base (the gate's checks, and
    the base version it was trained on): client name -> {ref, source, name, version, label}."""
    from serve.online.adapters import resolve_adapter

    base = engine.ModelInfo(ref=model.ref, uri=model.source, name=model.name, version=model.version)
    out = {}
    for name, ref in cfg.lora.adapters.items():
        a = resolve_adapter(ref, model.source, base, cfg.model_cache_dir or None, cfg.lora.max_lora_rank,
                            where=f"lora.adapters.{name}")
        out[name] = a.pinned()
    return out


def engine_deployment_name(cfg: Config) -> str:
    """The Serve deployment of the engine replicas (Ray's builder: `LLMServer:` + the model id, '/' and '.' replaced)."""
    return "LLMServer:" + cfg.served_model_id.replace("/", "--").replace(".", "_")


INGRESS_DEPLOYMENT = "RaylineIngress"  # Serve names the ingress deployment after its class (openai_ingress_app)


def routes_deployment_name(cfg: Config) -> str:
    """The deployment whose replicas serve the app's HTTP routes, and so run its canary split: the engine replicas
    (`ingress: engine`) or the separate OpenAI ingress (`ingress: deployment`)."""
    return engine_deployment_name(cfg) if cfg.ingress == "engine" else INGRESS_DEPLOYMENT


def adapters_of(app_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The adapter set in a deployed application config (as rendered here): client name -> pinned adapter."""
    for d in app_config.get("deployments") or []:
        if str(d.get("name", "")).startswith("LLMServer:"):
            return dict((d.get("user_config") or {}).get("adapters") or {})
    return {}


def application_args(cfg: Config, model: ServedModel | None) -> dict[str, Any]:
    """The builder's `args`: the serving config, and the pinned model (None: resolve `engine.model` at build time)."""
    return {"config": to_dict(cfg), "model": model.to_args() if model else None}


def render_serve_config(cfg: Config, model: ServedModel | None = None,
                        adapters: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `serve deploy` config (ServeDeploySchema) of this app; also a RayService's serveConfigV2.

    With `model` the app is pinned to that version; without (offline rendering, e.g. a RayService
    manifest) the builder resolves `cfg.engine.model` when the cluster builds the app. With LoRA on, the engine
    deployment's `user_config` holds the adapter set: `adapters` (pinned, resolve_served_adapters) or, without,
    cfg.lora.adapters' references, which each replica resolves itself. Serve hands a changed `user_config` to the
    running replicas (`reconfigure`) without restarting them, since it is not part of the code version.
    """
    app: dict[str, Any] = {
        "name": cfg.app_name,
        "route_prefix": cfg.route_prefix,
        "import_path": BUILDER,
        "args": application_args(cfg, model),
    }
    if cfg.lora.slots:
        pinned = adapters if adapters is not None else {name: {"ref": ref} for name, ref in cfg.lora.adapters.items()}
        app["deployments"] = [{"name": engine_deployment_name(cfg), "user_config": {"adapters": pinned}}]
    if cfg.runtime_env:
        app["runtime_env"] = cfg.runtime_env
    if not cfg.access_log:
        app["logging_config"] = {"enable_access_log": False}
    return {"http_options": {"host": cfg.http_host, "port": cfg.resolved_http_port()}, "applications": [app]}


def served_model_of(app_config: dict[str, Any]) -> ServedModel | None:
    """The pinned model in a deployed application config (as rendered here), or None."""
    model = (app_config.get("args") or {}).get("model")
    return ServedModel.from_args(model) if model else None


# vLLM configures logging with `logging.config.dictConfig` when imported, which closes every handler of the process,
# Serve's replica log handler included (its target becomes None). A replica then cannot be recovered by a Serve
# controller that restarted (after a GCS or head restart): the controller's `is_allocated()` call reads that
# handler's file and raises, and Serve replaces the replica (measured: both replicas of an app stopped and
# restarted, ~35 s without capacity). vLLM's own log lines go through a plain handler instead (serve.online.llm_hooks).
REPLICA_LOGGING_ENV = {"VLLM_CONFIGURE_LOGGING": "0"}
# A canary step is judged on the replicas' metrics as Prometheus stores them (serve/promotion/canary_metrics.py): reported every
# 2 s instead of Ray's 10, a step's figures are in Prometheus a few seconds after it, not ~15.
REPLICA_METRICS_ENV = {"RAY_metrics_report_interval_ms": str(metrics.REPORT_INTERVAL_MS)}


def _llm_config(cfg: Config, model: ServedModel, base_env: dict[str, str]):
    from ray.serve.llm import LLMConfig

    from serve.online.llm_hooks import EngineStartCallback

    engine_kwargs = {
        **cfg.lora.engine_kwargs(),
        **engine.vllm_engine_kwargs(cfg.engine),
        # vLLM frontend options (Ray routes them to the OpenAI layer): stamp the version on responses.
        "fingerprint_mode": "custom",
        "fingerprint_value": model.label,
    }
    # LLMConfig.runtime_env replaces the app's env_vars wholesale, so carry the app's own along.
    env_vars = {**base_env, **engine.runtime_env(cfg.engine).get("env_vars", {}), "RAYLINE_MODEL_VERSION": model.label,
                **REPLICA_LOGGING_ENV, **REPLICA_METRICS_ENV}
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


def build_app(args: dict[str, Any]):
    """Serve's `import_path` target: args (see `application_args`) -> the OpenAI app: the engine deployment serving
    the routes itself (`ingress: engine`), or Ray's OpenAI ingress deployment in front of it (`ingress: deployment`)."""
    import ray
    from ray import serve
    from ray.serve.llm import build_llm_deployment

    from serve.online.llm_hooks import RaylineServer, openai_ingress_app

    cfg = from_dict(Config, args.get("config") or {}, source="serve application args.config")
    model = ServedModel.from_args(args["model"]) if args.get("model") else resolve_served_model(
        cfg.engine.model, cfg.model_cache_dir or None
    )
    base_env = dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})
    llm = _llm_config(cfg, model, base_env)
    rayline = {**model.to_args(), "label": model.label}
    server = {"rayline": rayline, "request_metrics": cfg.request_metrics, "model_cache_dir": cfg.model_cache_dir,
              "max_lora_rank": cfg.lora.max_lora_rank,
              "auth": cfg.auth if cfg.ingress == "engine" else None}  # keys are checked where the routes are served
    # The engine replicas are RaylineServer either way; with `ingress: engine` they serve the routes themselves.
    engine = build_llm_deployment(llm, name_prefix="LLMServer:", bind_kwargs=server, deployment_cls=(
        serve.ingress()(RaylineServer) if cfg.ingress == "engine" else RaylineServer))
    if cfg.ingress == "engine":
        return engine
    return openai_ingress_app(llm, engine, {"num_replicas": cfg.ingress_replicas,
                                            "max_surge_percent": cfg.max_surge_percent,
                                            "ray_actor_options": {"num_cpus": cfg.ingress_cpus}},
                              rayline=rayline, request_metrics=cfg.request_metrics, auth=cfg.auth)
