"""Classes Ray Serve LLM instantiates for rayline: the OpenAI ingress and the engine start-up callback.

Kept apart from serve/app.py because importing them pulls in vLLM; rendering a serve config must not.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import HTTPException
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, OpenAIHTTPException
from ray.serve.llm.ingress import OpenAiIngress


class RaylineIngress(OpenAiIngress):
    """Ray's OpenAI ingress, plus the served version in `/v1/models` and OpenAI-style bodies for unknown models.

    `rayline` (bound at build time) is the pinned model: {name, version, alias, source, ref, label}; it
    appears as `metadata.rayline` of the model card.
    """

    def __init__(self, llm_deployments, model_cards, *, rayline: dict[str, Any] | None = None, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._rayline = dict(rayline or {})

    async def model(self, model_id: str) -> Optional[ModelCard]:
        card = await super().model(model_id)
        if card is None or not self._rayline:
            return card
        return card.model_copy(update={"owned_by": "rayline", "metadata": {**card.metadata, "rayline": self._rayline}})

    async def _get_model_id(self, model: Optional[str]) -> str:
        # The parent raises FastAPI's HTTPException, which renders as {"detail": ...}; clients of an
        # OpenAI API expect {"error": {...}}, which the ingress middleware writes for OpenAIHTTPException.
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            raise OpenAIHTTPException(
                status_code=e.status_code,
                message=f"{e.detail} Available models: {', '.join(sorted(self._model_cards))}.",
                type="invalid_request_error",
            ) from None


class LocalCheckpointCallback(CallbackBase):
    """Skip Ray's per-node model download tasks when the checkpoint is a directory every node already sees."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False
