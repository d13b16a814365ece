"""One engine config -> vLLM engine kwargs and Ray placement, for batch (ray.data.llm) and serving (ray.serve.llm).

CPU and GPU are one code path: `accelerator` picks the values, never a second branch in the callers.
On CPU the engine asks for no GPU, takes a fractional `cpus_per_engine`, and gets an explicit KV cache
(`kv_cache_memory_bytes`; vLLM's CPU default reserves 92% of RAM and fails on a shared box). On GPU,
`accelerator_type`, tensor/pipeline parallel sizes and a STRICT_PACK placement group come from the config.

What the callers use:
    cfg = EngineConfig(model="models:/rayline-tiny@champion", max_model_len=512, ...)
    path, info = resolve_model(cfg.model)          # local HF checkpoint dir + which version it is
    check_max_model_len(cfg, path)                 # refuse a context longer than the checkpoint's
    vllm_engine_kwargs(cfg)                        # `engine_kwargs` (the model goes in separately)
    placement_group_config(cfg)                    # `placement_group_config` (bundles + strategy)
    runtime_env(cfg)                               # `runtime_env` for the engine actors / replicas
    apply_engine_core_start()                      # in the engine actor, before the engine starts
    cfg.accelerator_type                           # `accelerator_type` (None on CPU)
Batch: `vLLMEngineProcessorConfig(model_source=path, engine_kwargs=..., placement_group_config=...,
runtime_env=..., accelerator_type=...)`. Serving: `LLMConfig(model_loading_config={"model_id": ...,
"model_source": path}, engine_kwargs=..., placement_group_config=..., runtime_env=..., accelerator_type=...)`
and `info.label` ("name/3") is the served model version to report. Plain vLLM: put
`runtime_env(cfg)["env_vars"]` in os.environ before vLLM is imported, then `vllm.LLM(model=path, **vllm_engine_kwargs(cfg))`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core import registry, storage
from core.config import require
from serve.online.precision import resolve_dtype

MiB = 1024**2
ENGINE_CORE_START_ENV = "RAYLINE_ENGINE_CORE_START"

# Engine kwargs that have a typed field here; passing them through `engine_kwargs` would shadow the field.
TYPED_KWARGS = {
    "model", "max_model_len", "max_num_seqs", "dtype", "enforce_eager", "enable_prefix_caching",
    "enable_chunked_prefill", "max_num_batched_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization",
    "tensor_parallel_size", "pipeline_parallel_size", "seed",
}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts (vllm/config/lora.py)."""


@dataclass
class EngineConfig:
    model: str
    """`models:/name@alias`, `models:/name/N`, a local path or an s3:// URI of a Hugging Face checkpoint."""
    max_model_len: int = 2048
    """Context length (prompt + output tokens); longer prompts are refused before they reach the engine."""
    max_num_seqs: int = 64
    """Sequences the engine schedules at once."""
    dtype: str = "auto"
    """`auto`: bfloat16 on a CPU with AVX-512 BF16 or AMX (float32 on other CPUs), vLLM's `auto` on GPU
    (serve/online/precision.py); resolved where the engine arguments are built (the serving or batch driver, which runs
    on the cluster's nodes); or a vLLM dtype (float32, bfloat16, float16)."""
    enforce_eager: bool = False
    """Skip compilation (vLLM on CPU: no inductor compile and no warm-up pass, so a faster start)."""
    enable_prefix_caching: bool | None = None
    """None keeps vLLM's default."""
    enable_chunked_prefill: bool | None = None
    """None keeps vLLM's default."""
    max_num_batched_tokens: int | None = None
    """Tokens per scheduler step; None keeps vLLM's default."""
    kv_cache_memory_bytes: int = 256 * MiB
    """KV cache size on CPU (always explicit there). On GPU the cache is `gpu_memory_utilization` instead."""
    gpu_memory_utilization: float = 0.9
    accelerator: Literal["cpu", "gpu"] = "cpu"
    accelerator_type: str | None = None
    """GPU model the engine must land on, as Ray names it (e.g. "H100", "A100", "L4"); GPU only."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    cpus_per_engine: float = 1.0
    """Logical CPUs per engine (per GPU worker on GPU). Fractional on CPU so the stages around it fit the node."""
    seed: int = 0
    engine_core_start: Literal["auto", "fork", "spawn"] = "auto"
    """How an engine actor starts vLLM's EngineCore process. vLLM spawns it inside a Ray actor (and always on
    CPU), so the new process imports vLLM again (~8 s on 2 cores); `fork` copies the actor, vLLM already
    imported. `auto`: fork on CPU, spawn on GPU (CUDA does not survive a fork)."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Extra environment for the engine processes (e.g. VLLM_CPU_OMP_THREADS_BIND)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Any other vLLM engine argument, passed through as is."""

    def __post_init__(self) -> None:
        require(bool(self.model.strip()), "model", "must name a model (models:/name@alias, a path or s3:// URI)")
        require(self.max_model_len >= 16, "max_model_len", f"must be at least 16, got {self.max_model_len}")
        require(self.max_num_seqs >= 1, "max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens", f"must be at least 1 or null, got {self.max_num_batched_tokens}",
        )
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        require(
            self.pipeline_parallel_size >= 1, "pipeline_parallel_size", f"must be >= 1, got {self.pipeline_parallel_size}"
        )
        require(self.cpus_per_engine > 0, "cpus_per_engine", f"must be > 0, got {self.cpus_per_engine}")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        shadowed = sorted(TYPED_KWARGS & set(self.engine_kwargs))
        require(
            not shadowed, f"engine_kwargs.{shadowed[0] if shadowed else ''}",
            "has its own field in the engine config; set it there instead",
        )
        if self.accelerator == "cpu":
            require(
                self.kv_cache_memory_bytes >= 1 * MiB, "kv_cache_memory_bytes",
                f"must be set on CPU (at least 1 MiB, e.g. {128 * MiB} for 128 MiB), got {self.kv_cache_memory_bytes}",
            )
            require(
                self.accelerator_type is None, "accelerator_type",
                f"{self.accelerator_type!r} given with accelerator: cpu; remove it or set accelerator: gpu",
            )
            require(
                self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1, "tensor_parallel_size",
                "the CPU engine runs one worker; tensor/pipeline parallel sizes must be 1 (use accelerator: gpu)",
            )
        else:
            require(
                self.cpus_per_engine >= 1, "cpus_per_engine",
                f"must be at least 1 per GPU worker on GPU, got {self.cpus_per_engine}",
            )
            require(
                self.accelerator_type is None or bool(self.accelerator_type.strip()),
                "accelerator_type", "must be a GPU type name such as H100, or null for any GPU",
            )

    @property
    def num_workers(self) -> int:
        """Devices one engine spans (tensor x pipeline parallel)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def vllm_engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM engine arguments for `cfg`, without the model (each caller passes that its own way)."""
    kwargs: dict[str, Any] = {
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": resolve_dtype(cfg.dtype, cfg.accelerator),
        "enforce_eager": cfg.enforce_eager,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "seed": cfg.seed,
    }
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens"):
        if getattr(cfg, name) is not None:
            kwargs[name] = getattr(cfg, name)
    if cfg.accelerator == "cpu":
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        # The model runs inside EngineCore (vLLM's own default for one worker). Ray Serve LLM would otherwise
        # add a model-worker process that EngineCore drives step by step over shared memory, which on 2 cores
        # costs the engine a core's share. The serving figures on equal terms (both `uni`) are in the README.
        kwargs["distributed_executor_backend"] = "uni"
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    kwargs.update(cfg.engine_kwargs)
    return kwargs


def placement_bundles(cfg: EngineConfig) -> list[dict[str, float]]:
    """Ray resource bundles of one engine: one CPU-only bundle on CPU, one GPU bundle per worker on GPU."""
    if cfg.accelerator == "cpu":
        # No "GPU" key at all: ray.data.llm reads the bundle sums as the engine actor's num_cpus/num_gpus,
        # and without a bundle it defaults to one GPU per engine, which never schedules on a CPU node.
        return [{"CPU": cfg.cpus_per_engine}]
    return [{"CPU": cfg.cpus_per_engine, "GPU": 1.0} for _ in range(cfg.num_workers)]


def placement_strategy(cfg: EngineConfig) -> str:
    """STRICT_PACK on GPU: tensor-parallel workers talk over NVLink/shared memory, so one node."""
    return "STRICT_PACK" if cfg.accelerator == "gpu" else "PACK"


def placement_group_config(cfg: EngineConfig) -> dict[str, Any]:
    """`placement_group_config` as both ray.data.llm and ray.serve.llm take it."""
    return {"bundles": placement_bundles(cfg), "strategy": placement_strategy(cfg)}


def runtime_env(cfg: EngineConfig) -> dict[str, Any]:
    """Runtime env for the engine processes: the CPU defaults below, then `env_vars` (which win)."""
    env: dict[str, str] = {}
    if cfg.accelerator == "cpu":
        env.update({
            # Run the CPU model worker inside the engine-core process instead of a third process pinned to one
            # core with the other reserved for the scheduler: one fewer process to spawn and import, and no
            # per-step IPC between polling processes. In a Ray actor on a 2-core node this measured ~3x the
            # output tokens/s and half the start-up (593 vs 188 tok/s, 215 vs 416 s; bench_batch_infer.py).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # Compute threads follow the CPUs the engine reserved, so engines and stages do not oversubscribe.
            "OMP_NUM_THREADS": str(max(1, math.floor(cfg.cpus_per_engine))),
            # Tokenizer threads would fight the engine's threads for the same few cores.
            "TOKENIZERS_PARALLELISM": "false",
        })
    if engine_core_start_method(cfg) == "fork":
        env[ENGINE_CORE_START_ENV] = "fork"
    env.update({k: str(v) for k, v in cfg.env_vars.items()})
    return {"env_vars": env} if env else {}


def engine_core_start_method(cfg: EngineConfig) -> str:
    """`fork` or `spawn`: `engine_core_start`, with `auto` resolved (fork on CPU, spawn on GPU)."""
    if cfg.engine_core_start != "auto":
        return cfg.engine_core_start
    return "fork" if cfg.accelerator == "cpu" else "spawn"


def apply_engine_core_start() -> str:
    """In an engine actor, before its vLLM engine starts: start EngineCore the way runtime_env() said.

    vLLM has no setting for this (its CPU platform and its Ray-actor check both force `spawn`), so with
    `fork` this replaces the start-method lookup of vLLM's EngineCore launcher. Only that launcher: vLLM's
    own workers and everything else keep vLLM's choice. Returns the method in effect."""
    if os.environ.get(ENGINE_CORE_START_ENV) != "fork":
        return "spawn"
    import multiprocessing

    from vllm.v1.engine import utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    return "fork"


def check_max_model_len(cfg: EngineConfig, model_path: str) -> None:
    """Fail before any engine starts when `max_model_len` exceeds the checkpoint's context (vLLM would refuse
    it inside an engine actor, where the error is harder to find)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    if limit and cfg.max_model_len > limit and "hf_overrides" not in cfg.engine_kwargs:
        raise ValueError(
            f"engine.max_model_len: {cfg.max_model_len} is more than the model's context "
            f"({limit} max_position_embeddings in {model_path}/config.json); lower it"
        )


@dataclass(frozen=True)
class ModelInfo:
    """Which model a reference resolved to; `name`/`version` are set for MLflow registry references."""

    ref: str
    uri: str
    """The exported checkpoint (s3:// URI or local path) the registry points at, or the reference itself."""
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    """The model version's MLflow tags (its lineage: dataset version, base model, source run, ...)."""
    digest: str | None = None
    """sha256 digest of the files loaded (core/weights_manifest.py), checked against the registered one."""

    @property
    def label(self) -> str:
        """What a result row or a served response reports as the model version: `name/N`, else the reference."""
        return f"{self.name}/{self.version}" if self.name and self.version else self.ref


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rayline" / "models"


def resolve_model(ref: str, cache_dir: str | Path | None = None) -> tuple[str, ModelInfo]:
    """A model reference -> (local Hugging Face checkpoint directory, ModelInfo).

    MLflow references go through `registry.resolve_model_uri` (the exported checkpoint); s3:// checkpoints
    are copied into `cache_dir` because vLLM loads from a local directory.
    """
    local, info = resolve_checkpoint(ref, cache_dir)
    if not (Path(local) / "config.json").is_file():
        raise FileNotFoundError(
            f"model {ref}: no Hugging Face checkpoint (config.json) at {local}"
            + (f" (resolved from {info.uri})" if info.uri != ref else "")
            + "; point `model` at an exported checkpoint directory"
        )
    return local, info


def resolve_checkpoint(ref: str, cache_dir: str | Path | None = None) -> tuple[str, ModelInfo]:
    """Any checkpoint reference (a full model or an adapter) -> (local directory, ModelInfo), its bytes checked
    (`checked_digest`) before any engine loads them."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    name = version = alias = None
    tags: dict[str, str] = {}
    mv = None
    if ref.startswith("models:/"):
        mv = registry.get_version(ref)
        name, version, tags = mv.name, str(mv.version), dict(mv.tags)
        alias = registry.parse_model_ref(ref)[2]
        uri = registry.source_uri(mv, cache)
    else:
        uri = ref
    local = storage.local_copy(uri, cache)
    try:
        digest = checked_digest(local, mv)
    except ValueError:
        if Path(local).resolve().is_relative_to(cache.resolve()):  # a copy we made: the next try fetches it again
            shutil.rmtree(local, ignore_errors=True)
        raise
    return local, ModelInfo(ref=ref, uri=uri, name=name, version=version, alias=alias, tags=tags, digest=digest)


def checked_digest(uri: str, mv=None) -> str:
    """The sha256 digest of the checkpoint at `uri` (local or s3://). For a registry version `mv` it must be the
    digest it was registered with: a file changed, added or missing since raises `ManifestMismatch` naming it."""
    from core import weights_manifest

    if mv is None:
        return weights_manifest.build(uri)["digest"]
    mv = registry.origin_version(mv)
    registered = mv.tags.get(registry.TAG_WEIGHTS_DIGEST)
    if not registered:
        raise weights_manifest.ManifestMismatch(
            f"{mv.name}/{mv.version}: registered without a weights manifest ({registry.TAG_WEIGHTS_DIGEST} tag); "
            "register it again with core.registry.register_checkpoint so its bytes can be checked")
    return weights_manifest.verify(uri, registered, registry.registered_manifest(mv),
                                   what=f"{mv.name}/{mv.version}")["digest"]


def check_pinned_bytes(pinned: dict[str, Any]) -> str:
    """In a serving replica, before its engine loads anything: the files at `pinned["source"]` must hash to the
    digest the rollout's gate approved (`pinned["digest"]`, pinned with the version the replicas serve,
    serve/online/served_model.py). Returns the digest; raises `ManifestMismatch` naming the changed, added or missing
    file otherwise, so the replica never starts on them."""
    from core import weights_manifest

    label = pinned.get("label") or pinned.get("ref") or pinned.get("source")
    if not pinned.get("digest"):
        raise weights_manifest.ManifestMismatch(
            f"{label}: the app pins no weights digest for {pinned.get('source')}; deploy it through "
            "pipelines.serve or pipelines.rollout, which pin the bytes they checked")
    return weights_manifest.verify(pinned["source"], pinned["digest"], what=label)["digest"]
