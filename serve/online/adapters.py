"""PEFT LoRA adapters of a base model, for the engines that run them (issue 18): resolve each reference to a local
directory, check it against the base before any engine loads it, and the vLLM arguments that enable them.

An adapter is a registered model version of its own whose `rayline.base_model` tag names the exact base version
it was trained on (train/tracking.py). Resolving one here also checks that lineage: an adapter trained on
`models:/rayline-tiny/3` is refused on an engine that runs `rayline-tiny/4`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core import registry, storage
from serve.online import engine as eng



class AdapterError(ValueError):
    """An adapter that cannot run on the engine's base; the message names the adapter and what is wrong."""


@dataclass
class Adapter:
    path: str
    """Local directory holding adapter_config.json and adapter_model.safetensors."""
    info: eng.ModelInfo
    rank: int

    def pinned(self) -> dict:
        """The adapter as a serving `user_config` entry names it: {ref (one version), source, name, version, label,
        digest (of the files checked here: the replica loads them only if they still hash to it)}."""
        i = self.info
        ref = f"models:/{i.name}/{i.version}" if i.name and i.version else i.ref
        return {"ref": ref, "source": self.path, "name": i.name, "version": i.version, "label": i.label,
                "digest": i.digest}


def resolve_adapter(ref: str, base_path: str, base: eng.ModelInfo, cache_dir: str | Path | None = None,
                    max_lora_rank: int = eng.VLLM_LORA_RANKS[-1], where: str = "adapters") -> Adapter:
    """An adapter reference (`models:/name/N`, `models:/name@alias`, s3:// or a local directory) -> its local copy,
    checked against the base checkpoint at `base_path` (files, rank, target modules, every weight's shape) and,
    when both are registry versions, against the base version the adapter was trained on. `where` names the
    config field in errors."""
    from serve.online.adapter_check import ADAPTER_CONFIG, adapter_problems  # here: it imports torch (a batch driver must not)

    local, info = eng.resolve_checkpoint(ref, cache_dir)
    if not (Path(local) / ADAPTER_CONFIG).is_file():
        full = (Path(local) / "config.json").is_file()
        raise AdapterError(f"{where}: {ref} is not a PEFT adapter (no {ADAPTER_CONFIG} at {local})"
                           + ("; it is a full model: evaluate it as engine.model in a job of its own" if full else ""))
    trained_on = info.tags.get(registry.TAG_BASE_MODEL, "")
    if base.name and base.version and trained_on.startswith("models:/"):
        name, version, _ = registry.parse_model_ref(trained_on)
        if (name, version) != (base.name, base.version):
            raise AdapterError(f"{where}: {info.label} was trained on {trained_on}, but the base here is "
                               f"{base.label}")
    problems = adapter_problems(local, base_path, max_lora_rank)
    if problems:
        raise AdapterError(f"{where}: {ref} does not fit the base {base.label}: " + "; ".join(problems))
    config = json.loads(storage.read_text(storage.join(local, ADAPTER_CONFIG)))
    return Adapter(path=local, info=info, rank=int(config["r"]))


def lora_engine_kwargs(adapters: list[Adapter]) -> dict:
    """vLLM arguments for an engine that runs the base and all of `adapters` at once: LoRA on, the smallest rank
    vLLM accepts that holds the largest adapter, and room for every adapter in one batch (and in CPU memory)."""
    if not adapters:
        return {}
    rank = max(a.rank for a in adapters)
    return {"enable_lora": True, "max_lora_rank": next(r for r in eng.VLLM_LORA_RANKS if r >= rank),
            "max_loras": len(adapters), "max_cpu_loras": len(adapters)}
