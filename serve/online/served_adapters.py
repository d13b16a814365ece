"""The LoRA adapters an engine replica serves beside its base, swapped in place (issue 18, docs/LORA_SERVING.md).

The replica's `reconfigure(user_config)` (serve/online/llm_hooks.py) hands `AdapterSet.apply` the wanted set: client
name -> {ref, source, name, version, label}. For each new or changed adapter the files are copied to this node
(s3:// sources; a local directory is used as it is), a reference still unpinned (an alias, in an offline-rendered
RayService) is resolved and checked against the base first, and the engine loads it under a name of its own
(`<model_id>:<name>@<label>`). Only once it is loaded does the client name point at it: one dict assignment in
vLLM's model registry, so a request is answered wholly by the old version or wholly by the new one, never
refused, and requests in flight finish on the version they started with. Responses' `model` is that versioned
name, which is how a client sees which adapter version answered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from core import metrics, storage

log = logging.getLogger("ray.serve")


class AdapterSet:
    def __init__(self, engine, model_id: str, base: dict[str, Any], cache_dir: str, max_lora_rank: int,
                 metric_tags: dict[str, str] | None = None):
        self.engine, self.model_id, self.base = engine, model_id, dict(base)
        self.cache_dir, self.max_lora_rank = cache_dir, max_lora_rank
        self.metric_tags = metric_tags
        """`app` and `served_model` for rayline_served_adapter_version; None: no metric (outside a replica)."""
        self.served: dict[str, dict[str, Any]] = {}
        """Client name -> the pinned adapter it answers with now."""
        self.lock = asyncio.Lock()

    def client_name(self, name: str) -> str:
        return f"{self.model_id}:{name}"

    def version_of(self, served_name: str) -> dict[str, Any] | None:
        """The adapter behind a name vLLM reports (`<model_id>:<name>@<label>`), or None."""
        client, _, label = served_name.partition("@")
        name = client.removeprefix(f"{self.model_id}:")
        adapter = self.served.get(name)
        return adapter if adapter and adapter.get("label") == label else None

    async def apply(self, wanted: dict[str, dict[str, Any]]) -> None:
        """Serve exactly `wanted`: load what is new or changed, then point each client name at it; drop the rest.
        Raises (naming the adapter) when one cannot be loaded; those already swapped stay swapped."""
        async with self.lock:
            for name, spec in wanted.items():
                if self.served.get(name, {}).get("source") == spec.get("source") and "source" in spec:
                    continue
                pinned = spec if "source" in spec else await asyncio.to_thread(self._pin, name, spec["ref"])
                await self._load(name, pinned)
            for name in set(self.served) - set(wanted):
                self._models().lora_requests.pop(self.client_name(name), None)
                self._mark(name, self.served.pop(name), 0)

    def _mark(self, name: str, spec: dict[str, Any], value: int) -> None:
        """rayline_served_adapter_version for one adapter version: 1 while it answers, 0 once it does not."""
        if self.metric_tags is not None:
            metrics.gauge("rayline_served_adapter_version", value, **self.metric_tags, adapter=name,
                          model=spec.get("name") or "", version=str(spec.get("version") or ""))

    def _models(self):
        return self.engine._oai_models  # vLLM's OpenAIServingModels: the registry the HTTP routes read

    def _pin(self, name: str, ref: str) -> dict[str, Any]:
        from serve.online.adapters import resolve_adapter
        from serve.online.engine import ModelInfo

        base = ModelInfo(ref=self.base.get("ref", ""), uri=self.base.get("source", ""), name=self.base.get("name"),
                         version=self.base.get("version"))
        a = resolve_adapter(ref, self.base["source"], base, self.cache_dir or None, self.max_lora_rank,
                            where=f"lora.adapters.{name}")
        return a.pinned()

    async def _load(self, name: str, spec: dict[str, Any]) -> None:
        from vllm.lora.request import LoRARequest

        from serve.online.engine import default_cache_dir

        from serve.online.engine import check_pinned_bytes

        source = spec["source"]
        path = await asyncio.to_thread(storage.local_copy, source, self.cache_dir or default_cache_dir())
        # The adapter's bytes as the gate checked them, or it never reaches the engine every other adapter shares.
        await asyncio.to_thread(check_pinned_bytes, {**spec, "source": path})
        models = self._models()
        request = LoRARequest(lora_name=f"{self.client_name(name)}@{spec['label']}",
                              lora_int_id=models.lora_id_counter.inc(1), lora_path=path)
        try:
            await self.engine._engine_client.add_lora(request)
        except Exception as e:  # vLLM raises whatever its loader raised
            raise RuntimeError(f"lora.adapters.{name}: the engine could not load {spec['label']} from {source}: "
                               f"{type(e).__name__}: {e}") from e
        models.lora_requests[self.client_name(name)] = request
        previous, self.served[name] = self.served.get(name), dict(spec)
        if previous and previous.get("label") != spec.get("label"):
            self._mark(name, previous, 0)
        self._mark(name, spec, 1)
        log.info("adapter %s now answers with %s (%s)", self.client_name(name), spec["label"], path)
