"""The gate's checks of a LoRA adapter against its base, before any engine loads it (issue 18).

One engine serves the base and every adapter of it, so one bad adapter must never reach it: vLLM on CPU raised a
raw tensor-size error on an adapter whose shapes did not fit the base and then hung, and loaded an adapter whose
target modules the base lacks silently, changing nothing. Checked here from adapter_config.json, the safetensors
header of adapter_model.safetensors (never the weights) and the base's config.json (its layers built on the meta
device): files present, rank within the serving `max_lora_rank`, target modules that are linear layers of the
base, and every lora_A / lora_B matrix on a layer the base has, with the shape that layer needs.
"""

from __future__ import annotations

import json
import re

from pipelines import storage
from pipelines.model_layout import linear_layers
from serve.gate import safetensors_header

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def is_adapter(source: str) -> bool:
    """Whether the checkpoint at `source` is a PEFT adapter directory rather than a full model."""
    return storage.exists(storage.join(source, ADAPTER_CONFIG))


def _read_json(uri: str) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(storage.read_text(uri))
    except (OSError, ValueError) as e:
        return None, f"{uri}: unreadable ({e})"
    return (value, None) if isinstance(value, dict) else (None, f"{uri}: not a JSON object")


def adapter_problems(source: str, base_source: str, max_lora_rank: int) -> list[str]:
    """What keeps the PEFT adapter at `source` from loading onto the base checkpoint at `base_source` in an engine
    started with `max_lora_rank`, if anything."""
    try:
        files = set(storage.list_files(source))
    except (OSError, ValueError) as e:
        return [f"{source}: cannot list the adapter ({e})"]
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if f not in files]
    if missing:
        return [f"{source}: {f} is missing" for f in missing]
    config, problem = _read_json(storage.join(source, ADAPTER_CONFIG))
    if problem:
        return [problem]
    problems = []
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        return [f"{source}/{ADAPTER_CONFIG}: r={rank!r} is not a positive integer"]
    if rank > max_lora_rank:
        problems.append(f"{source}/{ADAPTER_CONFIG}: r={rank} exceeds the serving max_lora_rank {max_lora_rank}")
    base_config, problem = _read_json(storage.join(base_source, "config.json"))
    if problem:
        return problems + [f"the base: {problem}"]
    layers = linear_layers(base_config)
    short_names = {name.rsplit(".", 1)[-1] for name in layers}
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    lacking = [t for t in targets if t not in short_names]
    if lacking:
        problems.append(f"{source}/{ADAPTER_CONFIG}: target_modules {lacking} are not linear layers of the base "
                        f"{base_source} (it has {sorted(short_names)})")
    header, problem = safetensors_header(storage.join(source, ADAPTER_WEIGHTS))
    if problem:
        return problems + [problem]
    problems += _weight_problems(header, layers, rank, f"{source}/{ADAPTER_WEIGHTS}", base_source)
    return problems


def _weight_problems(header: dict, layers: dict[str, tuple[int, int]], rank: int, where: str,
                     base_source: str) -> list[str]:
    """lora_A is [r, in_features] and lora_B [out_features, r] of the base layer each pair sits on."""
    problems, seen = [], 0
    for key, meta in sorted(header.items()):
        if key == "__metadata__":
            continue
        match = _LORA_KEY.match(key)
        if not match:
            problems.append(f"{where}: {key} is not a lora_A/lora_B matrix (only LoRA weights can be served)")
            continue
        seen += 1
        module, ab = match["module"], match["ab"]
        if module not in layers:
            problems.append(f"{where}: {key} sits on {module}, which the base {base_source} does not have")
            continue
        fan_in, fan_out = layers[module]
        want = [rank, fan_in] if ab == "A" else [fan_out, rank]
        if list(meta.get("shape", [])) != want:
            problems.append(f"{where}: {key} has shape {meta.get('shape')}, the base's {module} needs {want} "
                            f"(an adapter of another base, or of another rank than r={rank})")
    if not seen and not problems:
        problems.append(f"{where}: holds no LoRA weights")
    return problems
