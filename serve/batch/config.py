"""The batch inference / evaluation stage's config: what to read, which engine, how to sample, where results go.

`configs/batch/*.yaml` mirror this dataclass; `python -m pipelines.batch_infer --config FILE key=value ...`
builds it with `core.config.load_config`, so a bad field fails before Ray starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from core.config import ConfigError, require
from core.node_labels import check_node_labels
from serve.batch.rows import sampling_problem
from serve.online.engine import EngineConfig

ROWS_IN_FLIGHT_PER_SEQ = 4
"""Rows in flight per engine, as a multiple of engine.max_num_seqs, when max_concurrent_batches is left unset."""

METRICS = ("exact_match", "contains")
"""Metrics eval mode can compute (serve/batch/metrics.py); `exact_match` is always computed."""


@dataclass
class SamplingConfig:
    """Default vLLM sampling parameters; a row's `sampling_params` mapping overrides any of them for that row."""

    max_tokens: int = 64
    min_tokens: int = 0
    temperature: float = 0.0
    """0 is greedy decoding (what eval wants: one answer per prompt, reproducible)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) turns top-k off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        problem = sampling_problem(self.as_params(), where="sampling")
        if problem:
            raise ConfigError(problem)

    def as_params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Config:
    engine: EngineConfig
    """The vLLM engine: model reference, context length, KV cache, placement (serve/online/engine.py)."""
    input_uri: str
    """A JSONL or Parquet file, or a directory of them (local path or s3://). Rows: `id`, and `messages` (chat,
    a trailing assistant message is the reference) or `prompt` (plain text, sent as is); optional `reference`,
    `task` and `sampling_params` (per-row overrides)."""
    output_uri: str
    """Directory (local or s3://) that receives the result Parquet files."""
    adapters: list[str] = field(default_factory=list)
    """PEFT LoRA adapters of engine.model (`models:/name/N`, `models:/name@alias`, s3:// or a local directory)
    answered in the same pass by the same engines: every input row goes to the base and to each adapter, the
    result rows' `model_version` says which answered, and eval mode scores and tags each version. Each is checked
    against the base (shapes, targets, the base version it was trained on) before any engine starts; the engines
    get LoRA on with a `max_lora_rank` that holds the largest."""
    compare: list[str] = field(default_factory=list)
    """Other full models (any reference engine.model takes: another version, a fine-tune of the same base) answered
    in the same job on the same rows, each by an engine pool of its own (`num_engines` engines, the same engine
    settings): the result rows' `model_version` says which answered, and eval mode scores and tags each version.
    With `adapters`, one job compares the base, its adapters and full fine-tunes on identical prompts."""
    mode: Literal["infer", "eval"] = "infer"
    """`eval` also computes metrics against the references and records them on the model version in MLflow."""
    input_format: Literal["auto", "jsonl", "parquet"] = "auto"
    """`auto` picks by extension (.jsonl/.json/.ndjson or .parquet)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    metrics: list[str] = field(default_factory=lambda: ["exact_match"])
    """Eval metrics to compute, log and tag on the model version (from METRICS)."""
    limit: int | None = None
    """Only the first N input rows (smoke runs; such a run is not resumable)."""
    overwrite: bool = False
    """Replace a finished run's output; otherwise a non-empty output directory is an error. An interrupted
    run's output is resumed, not replaced (see `resumable`)."""
    resumable: bool = True
    """Record which input rows are written (Ray Data's job-level checkpoint, keyed on each row's `source`), so
    that the same job started again after a crash answers only the rows not written yet and its output holds
    every input row exactly once (serve/batch/resume.py). Off when `limit` is set."""
    checkpoint_uri: str | None = None
    """Where that record is kept while the job runs; default `<output_uri>.checkpoint`, beside the output. On a
    cluster it must be storage every node reaches (s3://, or a shared mount). Deleted when the job ends."""
    progress_every_s: float = 10.0
    """Seconds between progress lines in the job log (rows written / planned, rows/s, ETA); 0 = none."""
    max_wait_s: float = 0.0
    """Seconds this stage may wait for cluster resources before it fails with the wait's report (what it asked for,
    what is free, what holds the rest, whether an autoscaler can add nodes: core/resource_wait.py); 0 = wait as
    long as it takes (the report is printed all the same, 10 s into a wait and every minute after)."""
    num_engines: int = 1
    """Engine actors: a fixed pool, all started at once (each holds engine.cpus_per_engine CPUs)."""
    node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the engine actors must land on, in Ray's label-selector syntax (`value`, `!value`,
    `in(a,b)`), e.g. a KubeRay GPU worker group's labels; {} = any node. Ray Data's `label_selector` for the
    engine stage's actors (the read, result and write tasks go anywhere)."""
    batch_size: int = 16
    """Rows per engine call."""
    max_concurrent_batches: int | None = None
    """Engine calls (batches) in flight per engine actor. Unset: enough for ROWS_IN_FLIGHT_PER_SEQ (4) x
    engine.max_num_seqs rows. A batch returns only when its longest request ends, so with mixed output lengths
    a batch slot is soon held by one or two long requests; rows in flight must far exceed max_num_seqs for the
    engine to stay full. Ray's stage admits at most 1.1 x max_num_seqs of them to vLLM at a time; the rest
    wait in the actor, not in vLLM's queue."""
    cpu_stage_num_cpus: float = 0.25
    """Logical CPUs per read/result/write task. Fractional so they fit beside the engine on a small
    node: Ray Data's default of 1 CPU per task, with the engine holding the rest, deadlocks a 2-core machine."""
    cache_dir: str | None = None
    """Where s3:// and MLflow-artifact checkpoints are copied for vLLM (default ~/.cache/rayline/models)."""
    mlflow_experiment: str = "rayline-eval"
    run_name: str | None = None
    """MLflow run name in eval mode (default `eval-<model label>`)."""
    dataset_name: str | None = None
    """What `eval.dataset` records (default the input URI)."""
    gate_config: str = ""
    """Eval mode: a rollout YAML whose `gate` judges each scored version now (tags gate.verdict / gate.reasons on
    its page, beside its eval report); "" = no verdict. Relative paths: the working directory, then the project."""

    def __post_init__(self) -> None:
        require(bool(self.input_uri.strip()), "input_uri", "must name a JSONL/Parquet file or directory")
        require(bool(self.output_uri.strip()), "output_uri", "must name a directory for the result Parquet files")
        unknown = [m for m in self.metrics if m not in METRICS]
        require(not unknown, "metrics", f"unknown metric {unknown[:1]}; known: {list(METRICS)}")
        require(self.limit is None or self.limit >= 1, "limit", f"must be at least 1 or null, got {self.limit}")
        require(self.progress_every_s >= 0, "progress_every_s", f"must be >= 0, got {self.progress_every_s}")
        require(self.max_wait_s >= 0, "max_wait_s", f"must be >= 0 (0 = no limit), got {self.max_wait_s}")
        require(self.num_engines >= 1, "num_engines", f"must be at least 1, got {self.num_engines}")
        for i, ref in enumerate(self.adapters):
            require(isinstance(ref, str) and bool(ref.strip()), f"adapters[{i}]", "must name an adapter")
            require(ref != self.engine.model, f"adapters[{i}]", "is engine.model itself (the base is always answered)")
            require(ref not in self.adapters[:i], f"adapters[{i}]", f"{ref} is listed twice")
        for i, ref in enumerate(self.compare):
            require(isinstance(ref, str) and bool(ref.strip()), f"compare[{i}]", "must name a model")
            require(ref != self.engine.model, f"compare[{i}]", "is engine.model itself (it is always answered)")
            require(ref not in self.compare[:i] and ref not in self.adapters, f"compare[{i}]", f"{ref} is listed twice")
        check_node_labels(self.node_labels, "node_labels")
        require(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        if self.max_concurrent_batches is None:
            rows = ROWS_IN_FLIGHT_PER_SEQ * self.engine.max_num_seqs
            self.max_concurrent_batches = math.ceil(rows / self.batch_size)
        require(
            self.max_concurrent_batches >= 1, "max_concurrent_batches",
            f"must be at least 1 or null (auto), got {self.max_concurrent_batches}",
        )
        require(
            0 < self.cpu_stage_num_cpus <= 1, "cpu_stage_num_cpus", f"must be in (0, 1], got {self.cpu_stage_num_cpus}"
        )
        if self.limit:
            self.resumable = False
        require(
            self.checkpoint_uri is None or self.checkpoint_uri.rstrip("/") != self.output_uri.rstrip("/"),
            "checkpoint_uri", "must not be output_uri itself (the output directory holds only result files)",
        )
        if self.mode == "eval" and "exact_match" not in self.metrics:
            self.metrics = ["exact_match", *self.metrics]
