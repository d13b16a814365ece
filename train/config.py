"""The train stage's config: `configs/train/*.yaml` mirrors `TrainConfig` field for field.

Checks that need only the config itself run in `__post_init__`; checks that need the dataset's
manifest, the base model or the cluster (batch larger than the data, a missing dataset, a run that
cannot fit) run in `train.preflight` on the driver, still before any worker starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from core.config import require
from core.node_labels import check_node_labels

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class ModelConfig:
    path: str
    """Base model: a Hugging Face directory, an s3:// URI, or `models:/NAME@ALIAS` / `models:/NAME/VERSION`."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Both take the block-diagonal 4D mask built from `segment_ids` for packed rows."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward: less activation memory for ~30% more compute."""
    fsdp_unit: Literal["layer", "model"] = "layer"
    """What FSDP2 gathers at a time. `layer`: each decoder layer is a unit of its own, all-gathered before its forward
    and backward and resharded after (a worker holds one whole layer at a time, at the cost of a collective per
    layer and pass). `model`: the whole model is one unit, gathered once per step and kept through backward (two
    collectives a step), for models that fit whole on each worker, where the collectives' latency outweighs their
    bytes (the tiny CPU model: ~25% less time per step with 2 gloo workers). Checkpoints are the same either way."""

    def __post_init__(self):
        require(self.fsdp_unit in ("layer", "model"), "model.fsdp_unit", f"{self.fsdp_unit!r}: expected layer or model")
        require(bool(self.path.strip()), "model.path", "must name a model directory, s3:// URI or models:/ reference")


@dataclass
class DataConfig:
    manifest_uri: str
    """The prepared dataset: `<output_uri>/<version>/manifest.json` from `pipelines.prepare_data` (or its directory)."""
    shuffle_buffer_rows: int = 256
    """Per-worker local shuffle buffer, reseeded every epoch; 0 keeps the prepared order."""
    materialize: list[str] = field(default_factory=lambda: ["eval"])
    """Splits read once into Ray's object store before training; the others are re-read from storage on
    every pass (each epoch, each eval). Keep a train split larger than the object store streaming."""

    def __post_init__(self):
        require(bool(self.manifest_uri.strip()), "data.manifest_uri", "must name a prepared dataset")
        require(self.shuffle_buffer_rows >= 0, "data.shuffle_buffer_rows", "must be >= 0")
        for i, split in enumerate(self.materialize):
            require(split in ("train", "eval"), f"data.materialize[{i}]", f"{split!r} is not a split (train, eval)")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (AdamW), reached after `warmup_steps` and decayed by cosine to `lr * min_lr_ratio`."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off."""

    def __post_init__(self):
        require(0 < self.lr < 1, "optim.lr", f"{self.lr} is not a learning rate in (0, 1)")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be within [0, 1]")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1", "betas must be within [0, 1)")
        require(self.eps > 0, "optim.eps", "must be > 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 = no clipping)")


@dataclass
class LoopConfig:
    micro_batch_size: int = 4
    """Packed rows per worker per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; global batch = micro_batch_size x num_workers x grad_accum_steps rows. In an
    elastic run (`scaling.num_workers: [min, max]`) this is the count at `max` workers and the global batch is kept
    at every size: a group of W workers accumulates micro_batch_size x grad_accum_steps x max / W rows each step."""
    epochs: int = 1
    max_steps: int = 0
    """Optimizer steps to run; 0 = `epochs` full passes over the train split."""
    eval_every_steps: int = 0
    """Eval loss on the eval split every N steps (and at start and end); 0 = at each epoch's end."""
    eval_batch_size: int = 8
    checkpoint_every_steps: int = 0
    """Sharded checkpoint every N steps (and always at the end); 0 = at each eval."""
    log_every_steps: int = 1
    seed: int = 0
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto = bf16 compute (fp32 master weights and reductions) on GPU, fp32 on CPU."""

    def __post_init__(self):
        for name in ("micro_batch_size", "grad_accum_steps", "epochs", "eval_batch_size", "log_every_steps"):
            require(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_every_steps", "checkpoint_every_steps", "seed"):
            require(getattr(self, name) >= 0, f"train.{name}", f"must be >= 0, got {getattr(self, name)}")


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train a LoRA adapter (peft) on the frozen base instead of every weight: only the adapter is trained, in the
    optimizer, in checkpoints and in the export, which is then PEFT's adapter directory."""
    rank: int = 8
    alpha: float = 16.0
    """The adapter's update is scaled by alpha / rank."""
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Short names of the base model's linear layers to adapt; checked against the model before training."""

    def __post_init__(self):
        require(self.rank >= 1, "lora.rank", f"must be >= 1, got {self.rank}")
        require(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "lora.dropout", f"must be within [0, 1), got {self.dropout}")
        require(bool(self.target_modules), "lora.target_modules", "must name at least one linear layer (e.g. q_proj)")
        for i, name in enumerate(self.target_modules):
            require(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)), f"lora.target_modules[{i}]",
                    f"{name!r} is not a module name (q_proj, v_proj, ...)")


@dataclass
class ScalingConfig:
    num_workers: int | tuple[int, int] = 2
    """Training workers: a number, or `[min, max]` for an elastic run (Ray Train's elastic worker group). An elastic
    run starts with as many as fit (at least `min`), goes on with fewer when a node is lost instead of waiting for a
    replacement, and grows back to `max` when nodes return; each resize resumes from the last checkpoint, resharded
    onto the new size, with the same global batch and data order (docs/ARCHITECTURE.md, "What train writes")."""
    resize_check_s: float = 60.0
    """Elastic runs: how often a healthy group looks for room to grow (or a reason to shrink), in seconds (Ray
    Train's `elastic_resize_monitor_interval_s`). Each resize restarts the group from the latest checkpoint."""
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Ray resources per training worker; empty = {"GPU": 1, "CPU": 1} on GPU, and on CPU an even share of
    the cluster's CPUs after `data_cpus` (at most 1 each)."""
    data_cpus: float = 1.0
    """CPUs left free for Ray Data ingest tasks; training workers that took them all would deadlock ingest."""
    node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the training workers must land on, in Ray's label-selector syntax (`value`, `!value`,
    `in(a,b)`), e.g. a KubeRay worker group's labels; {} = any node. Ray Train's `ScalingConfig.label_selector`."""
    max_wait_s: float = 0.0
    """Seconds this stage may wait for cluster resources before it fails with the wait's report (what it asked for,
    what is free, what holds the rest, whether an autoscaler can add nodes: core/resource_wait.py); 0 = wait as
    long as it takes (the report is printed all the same, 10 s into a wait and every minute after)."""

    def __post_init__(self):
        if isinstance(self.num_workers, (tuple, list)):
            require(len(self.num_workers) == 2, "scaling.num_workers",
                    f"{list(self.num_workers)}: an elastic size is [min, max], two numbers")
            self.num_workers = (int(self.num_workers[0]), int(self.num_workers[1]))
            require(1 <= self.min_workers <= self.max_workers, "scaling.num_workers",
                    f"{list(self.num_workers)}: an elastic size needs 1 <= min <= max")
            require(not self.node_labels, "scaling.node_labels",
                    "cannot pin an elastic run by node labels: Ray Train counts the workers that fit by resources "
                    "alone, so it would wait forever for a size the labels forbid; give the nodes it may use a custom "
                    "resource and ask for it in scaling.resources_per_worker")
        require(self.min_workers >= 1, "scaling.num_workers", "must be >= 1")
        require(self.resize_check_s > 0, "scaling.resize_check_s", f"must be > 0 seconds, got {self.resize_check_s}")
        check_node_labels(self.node_labels, "scaling.node_labels")
        require(self.data_cpus >= 0, "scaling.data_cpus", "must be >= 0")
        require(self.max_wait_s >= 0, "scaling.max_wait_s", f"must be >= 0 (0 = no limit), got {self.max_wait_s}")
        for k, v in self.resources_per_worker.items():
            require(v >= 0, f"scaling.resources_per_worker.{k}", f"must be >= 0, got {v}")
        gpus = self.resources_per_worker.get("GPU", 0)
        require(not (gpus and not self.use_gpu), "scaling.resources_per_worker.GPU",
                "asks for GPUs while scaling.use_gpu is false; set use_gpu: true")

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    def worker_resources(self, cluster_cpus: float, reserved_cpus: float = 0.0) -> dict[str, float]:
        """The resources each worker asks Ray for, defaults filled in; `reserved_cpus` are held by something else."""
        res = dict(self.resources_per_worker)
        if self.use_gpu:
            res.setdefault("GPU", 1.0)
            res.setdefault("CPU", 1.0)
        elif "CPU" not in res:
            share = (cluster_cpus - self.data_cpus - reserved_cpus) / self.max_workers
            res["CPU"] = math.floor(min(1.0, share) * 100) / 100 if share > 0 else 0.0
        return res


@dataclass
class CheckpointConfig:
    storage_path: str
    """Local directory or s3://bucket/prefix; the run lives in `<storage_path>/<run_name>/`."""
    num_to_keep: int = 2
    max_failures: int = 2
    """Worker-group restarts (from the latest checkpoint) before the job fails. A node's termination notice
    (a spot reclaim, a pod deleted) is not counted here: Ray Train retries those without limit."""
    save_on_notice: bool = True
    """When a node the run trains on gets its termination notice (SIGTERM to its `ray start --block`: a spot reclaim,
    a KubeRay pod deleted), take a checkpoint at the next step boundary if one fits before the node goes, then wait
    for Ray Train to restart the run from it (train/notice.py)."""
    notice_grace_s: float = 30.0
    """Seconds a worker node has from its termination notice to its end. The RayJob render gives worker pods this as
    Ray's drain window (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) and terminationGracePeriodSeconds this + 15 s; the
    deadline Ray then reports is what a notice's save must finish by (a notice without one gets this long)."""
    notice_margin_s: float = 3.0
    """Seconds a notice's save must leave before the deadline on top of its expected time."""
    save_estimate_s: float = 10.0
    """What a checkpoint is expected to take before the run has measured one; after that, the longest of its
    last 3 saves."""

    def __post_init__(self):
        require(bool(self.storage_path.strip()), "checkpoint.storage_path", "must be a local path or s3:// URI")
        require(self.num_to_keep >= 1, "checkpoint.num_to_keep", "must be >= 1 (the latest is needed to resume)")
        require(self.max_failures >= 0, "checkpoint.max_failures", "must be >= 0")
        require(self.notice_grace_s > 0, "checkpoint.notice_grace_s",
                f"must be > 0 seconds (the worker pods' drain window), got {self.notice_grace_s}")
        for name in ("notice_margin_s", "save_estimate_s"):
            require(getattr(self, name) >= 0, f"checkpoint.{name}", f"must be >= 0 seconds, got {getattr(self, name)}")


@dataclass
class ExportConfig:
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights dtype of the exported checkpoint; auto = bfloat16 when trained in bf16, else float32."""


@dataclass
class TrackingConfig:
    experiment: str = "rayline-train"
    """MLflow experiment; the run is named after `run_name` and a re-submission continues it."""
    register_as: str = "rayline-tiny"
    """Registered model the export becomes a new version of; empty = do not register."""


@dataclass
class TrainConfig:
    run_name: str
    """Names the checkpoint directory and the MLflow run; submitting the same name again resumes it."""
    model: ModelConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    mlflow: TrackingConfig = field(default_factory=TrackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        require(bool(RUN_NAME.match(self.run_name)), "run_name",
                f"{self.run_name!r} must be 1-100 letters, digits, '.', '_' or '-' (it names a directory)")
        require(not (self.train.precision == "bf16" and not self.scaling.use_gpu), "train.precision",
                "bf16 needs GPUs (scaling.use_gpu: true); on CPU use fp32 or auto")

    @property
    def bf16(self) -> bool:
        return self.scaling.use_gpu and self.train.precision in ("auto", "bf16")
