"""The DPO stage's config: `configs/post_train/dpo_*.yaml` mirrors `DpoConfig` field for field.

The model, optimizer, loop, scaling, checkpoint, export, MLflow and LoRA sections are the train stage's
(train/config.py) and mean the same; `preferences` is the preference data stage's (data/preference_config.py) and
`dpo` holds what DPO adds: beta and the reference model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from data.preference_config import PreferenceConfig
from core.config import require
from train.config import (
    RUN_NAME,
    CheckpointConfig,
    DataConfig,
    ExportConfig,
    LoopConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ScalingConfig,
    TrackingConfig,
    TrainConfig,
)


@dataclass
class DpoSettings:
    beta: float = 0.1
    """How far the policy may move from the reference: the loss is -log sigmoid(beta * margin of log-ratios)."""
    reference: str = ""
    """The frozen reference model (directory, s3:// URI, models:/NAME@ALIAS or /VERSION); empty = model.path, the
    policy's starting point (under LoRA, its base)."""
    reference_batch_size: int = 16
    """Pairs per batch of the Ray Data pass that scores the reference's log-probs."""
    reference_gpus: float = 0.0
    """GPUs of that pass's actor (0 = CPU)."""
    from_eval_run: str = ""
    """The flywheel: an MLflow eval run of the batch stage whose wrong answers become the pairs (chosen = the reference
    answer, rejected = the version's), added to preferences.inputs; its version and run go into the lineage."""
    shuffle_buffer_rows: int = 256
    """Per-worker local shuffle buffer of pairs, reseeded every epoch; 0 keeps the prepared order."""

    def __post_init__(self):
        require(0 < self.beta <= 100, "dpo.beta", f"{self.beta} must be in (0, 100]")
        require(self.reference_batch_size >= 1, "dpo.reference_batch_size", "must be >= 1")
        require(self.reference_gpus >= 0, "dpo.reference_gpus", "must be >= 0")
        require(self.shuffle_buffer_rows >= 0, "dpo.shuffle_buffer_rows", "must be >= 0")


@dataclass
class DpoConfig:
    run_name: str
    """Names the checkpoint directory and the MLflow run; submitting the same name again resumes it."""
    model: ModelConfig
    """The policy's starting point (usually the SFT fine-tune): trained in full, or a LoRA adapter on it."""
    preferences: PreferenceConfig
    checkpoint: CheckpointConfig
    dpo: DpoSettings = field(default_factory=DpoSettings)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    train: LoopConfig = field(default_factory=LoopConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    mlflow: TrackingConfig = field(default_factory=TrackingConfig)
    """Runs go to the train stage's experiment (its `rayline.stage` tag says dpo), which the trainer role writes."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        require(bool(RUN_NAME.match(self.run_name)), "run_name",
                f"{self.run_name!r} must be 1-100 letters, digits, '.', '_' or '-' (it names a directory)")
        require(bool(self.preferences.inputs or self.dpo.from_eval_run), "preferences.inputs",
                "give preference files, or dpo.from_eval_run (an eval run whose wrong answers become the pairs)")

    @property
    def reference(self) -> str:
        return self.dpo.reference or self.model.path

    def train_config(self, scored_manifest_uri: str) -> TrainConfig:
        """The train stage's config over the scored preference version: what the shared loop, planner and
        registration take."""
        data = DataConfig(manifest_uri=scored_manifest_uri, shuffle_buffer_rows=self.dpo.shuffle_buffer_rows,
                          materialize=["eval"])
        return TrainConfig(run_name=self.run_name, model=self.model, data=data, checkpoint=self.checkpoint,
                           optim=self.optim, train=self.train, scaling=self.scaling, export=self.export,
                           mlflow=self.mlflow, lora=self.lora)
