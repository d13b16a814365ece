"""The Ray Serve LLM application built from the serving `Config`, and the same app as a `serve deploy` config.

    render_serve_config(cfg, model)   -> {"http_options": ..., "applications": [{name, route_prefix, import_path, args}]}
    build_app(args)                   -> the Serve Application (`import_path: serve.online.app:build_app`)

The rendered dict is what `serve deploy` reads, what the dashboard's `PUT /api/serve/applications/`
takes and what a RayService carries as `serveConfigV2`. Its `args` hold the whole serving config and the version the
app was built with, so the builder needs nothing else. A pinned config also names the version its replicas serve in
the engine deployment's (and a separate ingress's) `ray_actor_options` (env var `RAYLINE_SERVED_MODEL`): a new version
of an app whose serving config is unchanged keeps the running app's `args`, so Serve skips its build task (a process
that imports vLLM) and only restarts the replicas, which take the version from that variable (`served_model_of`).

Which version answers: every non-streamed response and the last chunk of a stream carry
`system_fingerprint = "<registered name>/<version>"` (vLLM's custom fingerprint, set per engine, so it
names the replica that actually answered), and `GET /v1/models` lists the model with
`metadata.rayline = {name, version, alias, ref, label}` (registry names, never a storage path).

Every route but the liveness probes needs an API key (serve/online/api_auth.py, the serving config's `auth`), checked by the
replicas that serve the routes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core import registry, storage
from core.config import from_dict, to_dict
from serve.online import engine
from serve.online.serve_config import Config
from serve.online.served_model import SERVED_MODEL_ENV, ServedModel, replica_env_vars

BUILDER = "serve.online.app:build_app"


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


ENGINE_DEPLOYMENT_PREFIX = "LLMServer:"


def engine_deployment_name(cfg: Config) -> str:
    """The Serve deployment of the engine replicas (Ray's builder: `LLMServer:` + the model id, '/' and '.' replaced)."""
    return ENGINE_DEPLOYMENT_PREFIX + cfg.served_model_id.replace("/", "--").replace(".", "_")


def is_engine_deployment(deployment: dict[str, Any]) -> bool:
    """Whether a deployment entry of an application config (as rendered here) is the engine replicas'."""
    return str(deployment.get("name", "")).startswith(ENGINE_DEPLOYMENT_PREFIX)


def engine_deployment_of(app_config: dict[str, Any]) -> dict[str, Any]:
    """The engine replicas' deployment entry of an application config ({} when it has none)."""
    return next((d for d in app_config.get("deployments") or [] if is_engine_deployment(d)), {})


INGRESS_DEPLOYMENT = "RaylineIngress"  # Serve names the ingress deployment after its class (openai_ingress_app)


def routes_deployment_name(cfg: Config) -> str:
    """The deployment whose replicas serve the app's HTTP routes, and so run its canary split: the engine replicas
    (`ingress: engine`) or the separate OpenAI ingress (`ingress: deployment`)."""
    return engine_deployment_name(cfg) if cfg.ingress == "engine" else INGRESS_DEPLOYMENT


def adapters_of(app_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The adapter set in a deployed application config (as rendered here): client name -> pinned adapter."""
    return dict((engine_deployment_of(app_config).get("user_config") or {}).get("adapters") or {})


def application_args(cfg: Config, model: ServedModel | None) -> dict[str, Any]:
    """The builder's `args`: the serving config, and the model to build with (None: resolve `engine.model` at build
    time). The replicas serve the version in their actor options where the config pins one (`served_model_of`)."""
    return {"config": to_dict(cfg), "model": model.to_args() if model else None}


def _built_args(cfg: Config, model: ServedModel | None, running: dict[str, Any] | None) -> dict[str, Any]:
    """The `args` to deploy: the running app's, where it was built by this builder from the same serving config and
    runtime_env (Serve then reuses its build: same code version), else new ones built with `model`."""
    args = application_args(cfg, model)
    if running and model is not None and running.get("import_path") == BUILDER \
            and (running.get("args") or {}).get("config") == args["config"] \
            and (running.get("runtime_env") or {}) == (cfg.runtime_env or {}):
        return running["args"]
    return args


# What Ray Serve LLM's builder adds to the engine replicas' runtime_env (LLMServer.get_deployment_options, with
# RAYLLM_ENABLE_WORKER_PROCESS_SETUP_HOOK at its default): the actor options rendered below replace the built ones
# whole, so they carry it too. Guarded by tests/serve/test_internals_serve.py::test_rendered_actor_options_are_the_builders.
RAY_LLM_SETUP_HOOK = {"worker_process_setup_hook": "ray.llm._internal.serve._worker_process_setup_hook"}


def _actor_options(cfg: Config, model: ServedModel) -> dict[str, dict[str, Any]]:
    """Deployment name -> the `ray_actor_options` that pin `model` on its replicas: the builder's own options (the
    app's runtime_env is merged in by Serve), plus SERVED_MODEL_ENV. Options Serve applies without a build task; a
    changed value restarts the replicas as a rolling update, as a new code version would."""
    served = {SERVED_MODEL_ENV: model.to_env()}
    out = {engine_deployment_name(cfg): {"num_cpus": 0, "runtime_env": {
        **RAY_LLM_SETUP_HOOK, "env_vars": {**replica_env_vars(cfg, model, {}), **served}}}}
    if cfg.ingress != "engine":
        out[INGRESS_DEPLOYMENT] = {**ingress_actor_options(cfg), "runtime_env": {"env_vars": served}}
    return out


def ingress_actor_options(cfg: Config) -> dict[str, Any]:
    """The separate ingress's `ray_actor_options` as built (`ingress: deployment`)."""
    return {"num_cpus": cfg.ingress_cpus}


def render_serve_config(cfg: Config, model: ServedModel | None = None,
                        adapters: dict[str, dict[str, Any]] | None = None,
                        running: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `serve deploy` config (ServeDeploySchema) of this app; also a RayService's serveConfigV2.

    With `model` the app is pinned to that version (in its replicas' actor options); without (offline rendering, e.g.
    a RayService manifest) the builder resolves `cfg.engine.model` when the cluster builds the app. `running`: the
    app's config as deployed now, whose `args` are kept where the serving config is the same, so that a new version
    deploys without a build task. With LoRA on, the engine deployment's `user_config` holds the adapter set:
    `adapters` (pinned, resolve_served_adapters) or, without, cfg.lora.adapters' references, which each replica
    resolves itself. Serve hands a changed `user_config` to the running replicas (`reconfigure`) without restarting
    them, since it is not part of the code version.
    """
    app: dict[str, Any] = {
        "name": cfg.app_name,
        "route_prefix": cfg.route_prefix,
        "import_path": BUILDER,
        "args": _built_args(cfg, model, running),
    }
    deployments: dict[str, dict[str, Any]] = {}
    for name, options in (_actor_options(cfg, model) if model is not None else {}).items():
        deployments[name] = {"name": name, "ray_actor_options": options}
    if cfg.lora.slots:
        pinned = adapters if adapters is not None else {name: {"ref": ref} for name, ref in cfg.lora.adapters.items()}
        name = engine_deployment_name(cfg)
        deployments[name] = {**deployments.get(name, {"name": name}), "user_config": {"adapters": pinned}}
    if deployments:
        app["deployments"] = list(deployments.values())
    if cfg.runtime_env:
        app["runtime_env"] = cfg.runtime_env
    if not cfg.access_log:
        app["logging_config"] = {"enable_access_log": False}
    return {"http_options": {"host": cfg.http_host, "port": cfg.resolved_http_port()}, "applications": [app]}


def _pinned_env(app_config: dict[str, Any]) -> str | None:
    """SERVED_MODEL_ENV in the engine deployment's actor options of a deployed app config, if set."""
    options = engine_deployment_of(app_config).get("ray_actor_options") or {}
    return ((options.get("runtime_env") or {}).get("env_vars") or {}).get(SERVED_MODEL_ENV)


def served_model_of(app_config: dict[str, Any]) -> ServedModel | None:
    """The version a deployed application config (as rendered here) has its replicas serve, or None (unpinned): the
    one in the engine replicas' actor options, else (a config rendered before they carried it) the builder's."""
    pinned = _pinned_env(app_config)
    model = json.loads(pinned) if pinned else (app_config.get("args") or {}).get("model")
    return ServedModel.from_args(model) if model else None


def pin_model(app_config: dict[str, Any], model: ServedModel) -> dict[str, Any]:
    """A deployed app config (as rendered here) with its replicas pinned to `model` (a rollback's restore of a config
    deployed unpinned), its `args` and every other deployment option as they were."""
    cfg = from_dict(Config, (app_config.get("args") or {}).get("config") or {}, source="serve application args.config")
    deployments = {d.get("name"): dict(d) for d in app_config.get("deployments") or []}
    for name, options in _actor_options(cfg, model).items():
        deployments[name] = {**deployments.get(name, {"name": name}), "ray_actor_options": options}
    return {**app_config, "deployments": list(deployments.values())}




def build_app(args: dict[str, Any]):
    """Serve's `import_path` target: args (see `application_args`) -> the OpenAI app: the engine deployment serving
    the routes itself (`ingress: engine`), or Ray's OpenAI ingress deployment in front of it (`ingress: deployment`)."""
    import ray
    from ray import serve
    from ray.serve.llm import build_llm_deployment

    from serve.online.engine_start import build_llm_config
    from serve.online.llm_hooks import RaylineServer, openai_ingress_app

    cfg = from_dict(Config, args.get("config") or {}, source="serve application args.config")
    model = ServedModel.from_args(args["model"]) if args.get("model") else resolve_served_model(
        cfg.engine.model, cfg.model_cache_dir or None
    )
    base_env = dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})
    llm = build_llm_config(cfg, model, base_env)
    rayline = {**model.to_args(), "label": model.label}
    server = {"rayline": rayline, "serving_config": to_dict(cfg),
              "request_metrics": cfg.request_metrics, "model_cache_dir": cfg.model_cache_dir,
              "max_lora_rank": cfg.lora.max_lora_rank,
              "auth": cfg.auth if cfg.ingress == "engine" else None}  # keys are checked where the routes are served
    # The engine replicas are RaylineServer either way; with `ingress: engine` they serve the routes themselves.
    engine = build_llm_deployment(llm, name_prefix=ENGINE_DEPLOYMENT_PREFIX, bind_kwargs=server, deployment_cls=(
        serve.ingress()(RaylineServer) if cfg.ingress == "engine" else RaylineServer))
    if cfg.ingress == "engine":
        return engine
    return openai_ingress_app(llm, engine, {"num_replicas": cfg.ingress_replicas,
                                            "max_surge_percent": cfg.max_surge_percent,
                                            "ray_actor_options": ingress_actor_options(cfg)},
                              rayline=rayline, request_metrics=cfg.request_metrics, auth=cfg.auth)
