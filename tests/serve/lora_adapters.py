"""PEFT adapters of the tiny model for the LoRA tests (batch and serving), written by peft itself."""

from __future__ import annotations

from stack.tiny_model import build_adapter


def write_adapter(base_dir, out, seed: int | None):
    """A rank-4 PEFT adapter of `base_dir` on q_proj and v_proj: peft's initialisation (lora_B zero: a no-op)
    when `seed` is None, else random weights from `seed` that change the answers (stack/tiny_model.py)."""
    return build_adapter(base_dir, out, seed, rank=4)


def register_base_with_adapters(base: str, adapters: str, base_dir, root) -> tuple[str, dict]:
    """`base_dir` registered as a fresh version of `base` (alias `champion`), and three adapters of it (seeds 1-3) as
    versions 1-3 of `adapters` (version 1 `champion`). Returns the base version and the serving config's `lora`:
    `a` by alias (version 1), `b` pinned to version 2; version 3 (another `a`) waits for a promotion."""
    from core import registry
    from tests.serve.serving import register_fresh

    (version,) = register_fresh(base, [(str(base_dir), {})])
    registry.set_alias(base, "champion", version)
    tags = {registry.TAG_BASE_MODEL: f"models:/{base}/{version}", registry.TAG_ADAPTER: "lora"}
    register_fresh(adapters, [(str(write_adapter(base_dir, root / f"v{seed}", seed)), tags) for seed in (1, 2, 3)])
    registry.set_alias(adapters, "champion", "1")
    return version, {"adapters": {"a": f"models:/{adapters}@champion", "b": f"models:/{adapters}/2"}, "max_lora_rank": 8}
