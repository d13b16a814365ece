"""Classes Ray Serve LLM instantiates for rayline: the engine replica that serves the OpenAI routes itself, the
separate OpenAI ingress, and the engine start-up callback.

Kept apart from serve/online/app.py because importing them pulls in vLLM; rendering a serve config must not.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from core.collector import heavy_imports, preload

with heavy_imports():  # a replica's start is mostly these imports (core/collector.py)
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, Response
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, OpenAIHTTPException
    from ray.serve.llm import LLMServer
    from ray.serve.llm.ingress import OpenAiIngress

    # What LLMServer's start imports later: vLLM's engine and its OpenAI app (served in-process).
    preload("vllm.v1.engine.async_llm", "vllm.entrypoints.openai.api_server")

from core import metrics
from serve.online.api_auth import ApiAuth, Gate
from serve.online.engine_start import build_llm_config
from serve.online.serve_config import Config
from serve.online.served_model import ServedModel, served_from_env


def public_version(spec: dict[str, Any]) -> dict[str, Any]:
    """A served version as model cards show it: registry names and versions, never where its files are stored (no
    `source`; no `ref` or `label` that is a path or URI rather than `models:/...` or `name/N`)."""
    registered = bool(spec.get("name") and spec.get("version"))
    return {k: v for k, v in spec.items() if k != "source" and (k != "ref" or str(v).startswith("models:/"))
            and (k != "label" or registered)}


def _root(card: dict[str, Any], spec: dict[str, Any], fallback: str) -> dict[str, Any]:
    """vLLM's card names the weights' local path as `root`: the version's label instead (else `fallback`)."""
    if "root" not in card:
        return {}
    return {"root": public_version(spec).get("label") or fallback}


def stamp_version(card: dict[str, Any], model_id: str, rayline: dict[str, Any]) -> dict[str, Any]:
    """A model card (as JSON) with the served version as `metadata.rayline`, when it is the served model's card."""
    if card.get("id") != model_id or not rayline:
        return card
    return {**card, **_root(card, rayline, model_id), "owned_by": "rayline",
            "metadata": {**(card.get("metadata") or {}), "rayline": public_version(rayline)}}


def _json_of(reply: Any) -> Any:
    if isinstance(reply, Response):
        return json.loads(reply.body)
    return reply.model_dump() if hasattr(reply, "model_dump") else reply


def adapter_card(card: dict[str, Any], adapters) -> dict[str, Any]:
    """vLLM's card of a loaded adapter (its id the versioned `<model_id>:<name>@<label>`) as clients name it, with
    the version as `metadata.rayline`; other cards as they are. `adapters`: the replica's AdapterSet, or None."""
    spec = adapters.version_of(card.get("id", "")) if adapters else None
    if spec is None:
        return card
    client_id = card["id"].partition("@")[0]
    return {**card, "id": client_id, "root": public_version(spec).get("label") or client_id, "owned_by": "rayline",
            "metadata": {**(card.get("metadata") or {}), "rayline": {**public_version(spec), "adapter": True}}}


def add_version_to_model_routes(app: FastAPI, model_id: str, rayline: dict[str, Any], adapters=None) -> None:
    """Wrap vLLM's `GET /v1/models` and Ray's `GET /v1/models/{model}` so the served card names the version (and
    each served adapter's card its adapter version, `adapters` being the replica's AdapterSet)."""
    for route in list(app.router.routes):
        path = getattr(route, "path", None)
        if path not in ("/v1/models", "/v1/models/{model:path}") or "GET" not in getattr(route, "methods", ()):
            continue
        original = route.endpoint
        app.router.routes.remove(route)
        if path == "/v1/models":
            async def list_models(raw_request: Request, _original=original) -> JSONResponse:
                body = _json_of(await _original(raw_request))
                body["data"] = [adapter_card(stamp_version(c, model_id, rayline), adapters)
                                for c in body.get("data", []) if not adapters or "@" not in c.get("id", "")
                                or adapters.version_of(c["id"])]  # superseded adapter versions left out
                return JSONResponse(body)

            app.add_api_route(path, list_models, methods=["GET"])
        else:
            async def retrieve_model(model: str, _original=original) -> JSONResponse:
                name = model.removeprefix(f"{model_id}:")
                if adapters and model != name and name in adapters.served:
                    spec = adapters.served[name]
                    return JSONResponse(adapter_card({"id": f"{model}@{spec['label']}", "object": "model",
                                                      "parent": model_id}, adapters))
                try:
                    card = _json_of(await _original(model))
                except HTTPException as e:
                    return JSONResponse(
                        {"error": {"message": f"{e.detail}", "type": "invalid_request_error", "code": e.status_code}},
                        status_code=e.status_code,
                    )
                return JSONResponse(stamp_version(card, model_id, rayline))

            app.add_api_route(path, retrieve_model, methods=["GET"])


class RaylineServer(LLMServer):
    """The engine replica as the app's ingress: it serves vLLM's own OpenAI app in-process (Ray builds it in
    `__serve_build_asgi_app__`, as its direct-streaming layout does), plus the served version in the model cards.

    `rayline` (bound at build time) is the model the app was built with: {name, version, alias, source, ref, label},
    replaced by the version the replica's actor options pin (serve/online/app.py SERVED_MODEL_ENV) where they pin
    another, together with the LLMConfig built from `serving_config` for it; `auth` the serving config's AuthConfig
    when this replica serves the routes (`ingress: engine`), else None.
    """

    async def __init__(self, llm_config, *, rayline: dict[str, Any] | None = None,
                       serving_config: dict[str, Any] | None = None, request_metrics: bool = True,
                       model_cache_dir: str = "", max_lora_rank: int = 16, auth=None, **kwargs):
        # Before the engine starts: a replica that cannot check keys fails in a second, not after loading a model.
        self._gate = Gate.from_config(auth) if auth is not None else None
        llm_config, rayline = repinned(llm_config, rayline, serving_config)
        self._rayline = dict(rayline or {})
        self._request_metrics = request_metrics
        if self._rayline:  # the bytes the gate approved, or no engine at all
            import asyncio

            from serve.online.engine import check_pinned_bytes

            await asyncio.to_thread(check_pinned_bytes, self._rayline)
        await super().__init__(llm_config, **kwargs)
        self._model_id = llm_config.model_id  # kept here: LLMServer's own copy of the config is private
        from serve.online.canary_split import CanaryState

        self._canary = CanaryState({"app": served_tags(llm_config.model_id, self._rayline)["app"]})
        self._adapters = None
        if llm_config.engine_kwargs.get("enable_lora"):
            from serve.online.served_adapters import AdapterSet

            tags = served_tags(llm_config.model_id, self._rayline)
            self._adapters = AdapterSet(self.engine, llm_config.model_id, self._rayline, model_cache_dir, max_lora_rank,
                                        metric_tags={k: tags[k] for k in ("app", "served_model")})

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's call with the deployment's `user_config` (serve/online/app.py), at start and whenever it changes: the
        adapter set, swapped in place (serve/online/served_adapters.py), and a canary's split (serve/online/canary_split.py)."""
        self._canary.configure((user_config or {}).get("canary"))
        wanted = (user_config or {}).get("adapters") or {}
        if self._adapters is None:
            if wanted:
                raise ValueError("adapters given, but this app's engines run without LoRA (lora.max_adapters: 0)")
            return
        await self._adapters.apply(wanted)

    async def adapter_cards(self) -> list[dict[str, Any]]:
        """The model cards of the adapters this replica serves now, as clients name them (`<model_id>:<name>`), each
        with its version as `metadata.rayline`: what the separate ingress lists (`ingress: deployment`)."""
        if self._adapters is None:
            return []
        return [adapter_card({"id": f"{self._adapters.client_name(name)}@{spec['label']}", "object": "model",
                              "permission": [], "metadata": {}}, self._adapters)
                for name, spec in sorted(self._adapters.served.items())]

    async def __serve_build_asgi_app__(self):
        app = await super().__serve_build_asgi_app__()
        add_version_to_model_routes(app, self._model_id, self._rayline, self._adapters)
        return add_rayline_middleware(app, self._model_id, self._rayline, self._canary,
                                      self._request_metrics, self._gate)


def served_spec(rayline: dict[str, Any] | None) -> dict[str, Any] | None:
    """The served version as replicas hold it ({name, version, alias, source, ref, digest, label}): the one this
    replica's actor options pin (SERVED_MODEL_ENV), else `rayline` as bound at build time."""
    model = served_from_env()
    return {**model.to_args(), "label": model.label} if model else rayline


def repinned(llm_config, rayline: dict[str, Any] | None, serving_config: dict[str, Any] | None):
    """(LLMConfig, rayline) for the version this replica's actor options pin: as bound where that is the version the
    app was built with, else built again for it from the serving config, as the builder built the bound one (the
    app's env_vars being those the bound config carries)."""
    spec = served_spec(rayline)
    if spec == rayline or serving_config is None:
        return llm_config, rayline
    from core.config import from_dict

    cfg = from_dict(Config, serving_config, source="serve deployment serving_config")
    base_env = dict((llm_config.runtime_env or {}).get("env_vars") or {})
    return build_llm_config(cfg, ServedModel.from_args(spec), base_env), spec


def add_rayline_middleware(app, model_id: str, rayline: dict[str, Any], canary, request_metrics: bool, gate):
    """What every layout's routes get, on the app that serves them (the engine replica's, or the separate
    ingress's): the served-version gauge, responses counted by status, the canary split (a request it forwards to the
    challenger is not counted here), and outermost the API keys, limits and caps (serve/online/api_auth.py; its refusals
    counted by status too). `gate`: the replica's api_auth.Gate; the routes are never served without one."""
    from serve.online.canary_split import CanarySplit

    if gate is None:
        raise ValueError("the app's routes need API keys: the replica serving them was built without `auth`")
    tags = served_tags(model_id, rayline)
    counted = {k: tags[k] for k in ("app", "model", "version")}
    metrics.gauge("rayline_served_version", 1, **tags)
    if request_metrics:
        app.add_middleware(CountResponses, tags=counted)
    app.add_middleware(CanarySplit, state=canary)
    app.add_middleware(ApiAuth, gate=gate, on_refused=(lambda status: metrics.inc(
        "rayline_serve_requests", 1, code=str(status), **counted)) if request_metrics else None)
    return app


def served_tags(model_id: str, rayline: dict[str, Any]) -> dict[str, str]:
    """Labels of this replica's serving metrics: its Serve app, the served model id and the pinned version."""
    from ray import serve

    return {"app": serve.get_replica_context().app_name, "served_model": model_id,
            "model": rayline.get("name") or rayline.get("ref") or model_id, "version": str(rayline.get("version") or "")}


class CountResponses:
    """ASGI middleware: one `rayline_serve_requests` count per HTTP response, by status code. It only looks at the
    response's start message, so streamed chunks pass through untouched."""

    def __init__(self, app, tags: dict[str, str]):
        self.app, self.tags = app, tags

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                metrics.inc("rayline_serve_requests", 1, code=str(message["status"]), **self.tags)
            await send(message)

        return await self.app(scope, receive, counting_send)


class RaylineIngress(OpenAiIngress):
    """Ray's OpenAI ingress (`ingress: deployment`) in front of the RaylineServer engine replicas, plus the served
    version in `/v1/models`, the available models in an unknown model's 404, the canary split, and the adapters
    the engine replicas serve (`<model_id>:<name>`, listed and routed like the base: every engine replica holds the
    app's whole adapter set, serve/online/served_adapters.py, so requests need no multiplexed routing and no adapter is
    loaded through Ray's own LoRA loader).

    `rayline` (bound at build time) is the model the app was built with, replaced by the version the replica's actor
    options pin (`served_spec`); it appears as `metadata.rayline` of the model card.
    """

    def __init__(self, llm_deployments, model_cards, *, rayline: dict[str, Any] | None = None,
                 request_metrics: bool = True, auth=None, **kwargs):
        # The serving config's AuthConfig, checked before anything else starts.
        self._gate = Gate.from_config(auth) if auth is not None else None
        super().__init__(llm_deployments, model_cards, **kwargs)
        from serve.online.canary_split import CanaryState

        self._rayline = dict(served_spec(rayline) or {})
        self._request_metrics = request_metrics
        (self._model_id,) = model_cards  # rayline's app serves one model
        # Kept here from the arguments, not read back from the parent's private attributes.
        self._engine_handle = llm_deployments[self._model_id]
        self._served_ids = sorted(model_cards)
        self._canary = CanaryState({"app": served_tags(self._model_id, self._rayline)["app"]})

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's call with the ingress deployment's `user_config`: a canary's split (serve/online/canary_split.py), which
        in this layout the ingress replicas run in front of Ray's OpenAI routes."""
        self._canary.configure((user_config or {}).get("canary"))

    async def __serve_build_asgi_app__(self):
        # Serve calls this before the app starts (its lifespan), so middleware can still be added. The app is Ray's
        # OpenAI FastAPI app that `serve.ingress` bound to this class (make_fastapi_ingress).
        return add_rayline_middleware(self._asgi_app, self._model_id, self._rayline, self._canary,
                                      self._request_metrics, self._gate)

    def _is_adapter(self, model_id: str) -> bool:
        return model_id.startswith(f"{self._model_id}:")

    async def _adapter_cards(self) -> list[dict[str, Any]]:
        return await self._engine_handle.adapter_cards.remote()

    async def model(self, model_id: str) -> Optional[ModelCard]:
        if self._is_adapter(model_id):
            card = next((c for c in await self._adapter_cards() if c["id"] == model_id), None)
            return None if card is None else ModelCard.model_validate(card)
        card = await super().model(model_id)
        if card is None or not self._rayline:
            return card
        return ModelCard.model_validate(stamp_version(card.model_dump(), card.id, self._rayline))

    async def models(self):
        listed = await super().models()
        listed.data.extend(ModelCard.model_validate(c) for c in await self._adapter_cards())
        return listed

    def _get_configured_serve_handle(self, model_id: str):
        # An adapter goes to the base's engine replicas as the base does (any replica answers it), not through
        # Serve's multiplexed routing, which would have Ray load it from a LoRA path of its own.
        return super()._get_configured_serve_handle(self._model_id if self._is_adapter(model_id) else model_id)

    async def _get_model_id(self, model: Optional[str]) -> str:
        # The parent's 404 names only the base id it could not find; this one also names the models there are.
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            raise OpenAIHTTPException(
                status_code=e.status_code,
                message=f"{e.detail} Available models: {', '.join(self._served_ids)}.",
            ) from None  # Ray's error handler names the type after the exception class, whatever `type` says


def openai_ingress_app(llm_config, engine, options: dict[str, Any], **ingress_kwargs):
    """Ray's `build_openai_app` layout around `engine`, an engine deployment built by the caller: the RaylineIngress
    deployment wired as Ray's builder wires its ingress (its default options merged with `options` the same way),
    bound with `ingress_kwargs`. Ray's builder builds the engine deployment itself, as a plain LLMServer with no
    bind arguments; rayline's engine replicas are RaylineServer, which needs them (the pinned version, the adapter
    settings)."""
    from ray import serve
    from ray.serve.llm.ingress import make_fastapi_ingress
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata

    merged = maybe_apply_llm_deployment_config_defaults(RaylineIngress.get_deployment_options([llm_config]), options)
    model_id = llm_config.model_id
    return serve.deployment(make_fastapi_ingress(RaylineIngress), **merged).bind(
        llm_deployments={model_id: engine}, model_cards={model_id: to_model_metadata(model_id, llm_config)},
        **ingress_kwargs)
