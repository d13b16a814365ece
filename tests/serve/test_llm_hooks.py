"""The engine replica's OpenAI app names the served version in its model cards (no cluster, no engine)."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from serve.llm_hooks import add_version_to_model_routes, stamp_version

RAYLINE = {"name": "rayline-tiny", "version": "3", "alias": "champion", "label": "rayline-tiny/3"}


def engine_like_app() -> FastAPI:
    """The two model routes as vLLM's app (a JSONResponse list) and Ray's retrieve route (a card, 404 otherwise)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def show_available_models(raw_request: Request):  # vLLM's handler takes the raw request
        return JSONResponse({"object": "list", "data": [
            {"id": "rayline", "object": "model", "owned_by": "vllm"}, {"id": "other", "object": "model"}]})

    @app.get("/v1/models/{model:path}")
    async def _get_model(model: str):
        if model != "rayline":
            raise HTTPException(status_code=404, detail=f"Unknown model: {model}")
        return {"id": "rayline", "object": "model", "metadata": {"input_modality": "text"}}

    return app


def test_list_and_retrieve_carry_the_version_of_the_served_model_only():
    app = engine_like_app()
    add_version_to_model_routes(app, "rayline", RAYLINE)
    client = TestClient(app)
    served, other = client.get("/v1/models").json()["data"]
    assert served["metadata"]["rayline"] == RAYLINE and served["owned_by"] == "rayline"
    assert "metadata" not in other
    card = client.get("/v1/models/rayline").json()
    assert card["metadata"] == {"input_modality": "text", "rayline": RAYLINE}


def test_unknown_model_gets_an_openai_style_404():
    app = engine_like_app()
    add_version_to_model_routes(app, "rayline", RAYLINE)
    r = TestClient(app).get("/v1/models/gpt-9")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Unknown model: gpt-9" and r.json()["error"]["type"] == "invalid_request_error"


def test_stamp_leaves_cards_alone_without_a_pinned_model():
    card = {"id": "rayline", "owned_by": "vllm"}
    assert stamp_version(card, "rayline", {}) == card


def test_the_replica_keeps_the_executor_the_engine_kwargs_ask_for(monkeypatch):
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig
    from ray.serve.llm import LLMConfig

    from serve.llm_hooks import keep_requested_executor_backend

    # Restored after the test: the hook patches Ray's class for the whole (replica) process.
    monkeypatch.setattr(VLLMEngineConfig, "get_initialization_kwargs", VLLMEngineConfig.get_initialization_kwargs)

    def backend(**engine_kwargs) -> str:
        llm = LLMConfig(model_loading_config={"model_id": "m", "model_source": "/m"}, engine_kwargs=engine_kwargs,
                        accelerator_config={"kind": "cpu"})
        return VLLMEngineConfig.from_llm_config(llm).get_initialization_kwargs()["distributed_executor_backend"]

    assert backend(distributed_executor_backend="uni") == "mp"  # Ray's own choice on CPU
    keep_requested_executor_backend()
    keep_requested_executor_backend()  # once per process, however often the replica calls it
    assert backend(distributed_executor_backend="uni") == "uni"
    assert backend() == "mp"  # nothing asked: Ray's choice stands
