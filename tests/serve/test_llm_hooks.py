"""The engine replica's OpenAI app: vLLM's own routes, served by Ray Serve LLM, name the served version.

The model-route tests go to the app tests/serve/conftest.py deploys for the session (the tiny model on the
CPU engine, `ingress: engine`): RaylineServer wraps vLLM's `GET /v1/models` and Ray's `GET /v1/models/{model}`
there. The executor test runs Ray's own engine-config class, without an engine.
"""

from __future__ import annotations

import pytest

from serve.online.llm_hooks import public_version, stamp_version
from tests.serve.serving import SERVED_MODEL, http_json


def expected_stamp(served: dict) -> dict:
    """metadata.rayline as the app pins it: the registered version the alias pointed at when it was deployed."""
    return {"name": SERVED_MODEL, "version": served["version"], "alias": "champion", "label": served["label"],
            "ref": f"models:/{SERVED_MODEL}/{served['version']}"}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the session's app may start in this test's setup
def test_vllm_model_list_carries_the_served_version(served):
    status, body = http_json(served["base_url"] + "/models")
    assert status == 200 and body["object"] == "list", body
    (card,) = body["data"]
    assert card["id"] == "rayline" and card["object"] == "model" and card["owned_by"] == "rayline"
    stamp = card["metadata"]["rayline"]
    assert stamp.items() >= expected_stamp(served).items() and "source" not in stamp, stamp
    assert card["root"] == served["label"]  # vLLM's `root` named the checkpoint's local path
    assert card["max_model_len"] == 256  # vLLM's own card fields are kept


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_retrieve_route_carries_the_version_and_unknown_models_get_an_openai_404(served):
    status, card = http_json(served["base_url"] + "/models/rayline")
    assert status == 200 and card["id"] == "rayline", card
    assert card["metadata"]["rayline"].items() >= expected_stamp(served).items()
    status, body = http_json(served["base_url"] + "/models/gpt-9")
    assert status == 404
    assert body == {"error": {"message": "Unknown model: gpt-9", "type": "invalid_request_error", "code": 404}}


def test_cards_name_versions_never_where_the_files_are():
    registered = {"name": "rayline-tiny", "version": "3", "alias": "champion", "label": "rayline-tiny/3",
                  "ref": "models:/rayline-tiny/3", "source": "/home/u/.cache/rayline/models/rayline-tiny/3"}
    card = stamp_version({"id": "rayline", "root": registered["source"], "owned_by": "vllm"}, "rayline", registered)
    assert card["root"] == "rayline-tiny/3" and card["metadata"]["rayline"] == {
        k: v for k, v in registered.items() if k != "source"}
    # Served straight from a directory (no registry version): its ref and label are that path, so neither is shown.
    unregistered = {"ref": "s3://bucket/ckpt", "source": "s3://bucket/ckpt", "label": "s3://bucket/ckpt"}
    card = stamp_version({"id": "rayline", "root": "/tmp/x", "owned_by": "vllm"}, "rayline", unregistered)
    assert card["root"] == "rayline" and card["metadata"]["rayline"] == {} and "s3://" not in str(card)
    assert public_version(registered).keys() == {"name", "version", "alias", "label", "ref"}


def test_stamp_leaves_other_cards_and_unpinned_apps_alone():
    rayline = {"name": "rayline-tiny", "version": "3", "alias": "champion", "label": "rayline-tiny/3"}
    assert stamp_version({"id": "other", "owned_by": "vllm"}, "rayline", rayline) == {"id": "other", "owned_by": "vllm"}
    assert stamp_version({"id": "rayline", "owned_by": "vllm"}, "rayline", {}) == {"id": "rayline", "owned_by": "vllm"}


def test_the_replica_keeps_the_executor_the_engine_kwargs_ask_for(monkeypatch):
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig
    from ray.serve.llm import LLMConfig

    from serve.online.engine_start import keep_requested_executor_backend

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
