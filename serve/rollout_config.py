"""The rollout config: which alias to follow, the gate a version must pass, where and how to deploy it.

    python -m pipelines.rollout --model rayline-tiny [--alias champion] [--watch] [--config configs/rollout/tiny.yaml] [key=value ...]

The serving side (engine, placement, autoscaling) is not repeated here: `serve_config` names the
serving YAML (serve/serve_config.py) that the app is rendered from, with `serve_overrides` on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipelines.config import require
from pipelines.registry import DEFAULT_ALIAS


@dataclass
class GateConfig:
    """What a version must show before it is deployed; a failing version is refused and tagged with why."""

    min_metrics: dict[str, float] = field(default_factory=lambda: {"eval.exact_match": 0.0})
    """Version tag -> lowest acceptable value (tags written by batch eval). A missing tag fails the gate."""
    max_metrics: dict[str, float] = field(default_factory=dict)
    """Version tag -> highest acceptable value (e.g. an error rate)."""
    check_artifacts: bool = True
    """Require a complete checkpoint: config.json, tokenizer, every weight shard whole (safetensors headers)."""


@dataclass
class KubernetesConfig:
    """The RayService to update when `target: kubernetes`."""

    name: str = ""
    namespace: str = "default"
    serve_url: str = ""
    """OpenAI base URL the smoke request goes to (e.g. http://<name>-serve-svc.<ns>.svc:8000/v1)."""


@dataclass
class Config:
    model: str = ""
    """Registered model name; "" = the name in the serving config's `engine.model` (models:/NAME@alias)."""
    alias: str = DEFAULT_ALIAS
    adapter: str = ""
    """Follow this served LoRA adapter (a name in the serving config's `lora.adapters`) instead of the base: its
    alias rolls the new adapter version into the running replicas in place (no engine restart); `model` is then
    the adapter's registered model ("" = the name in its `lora.adapters` reference)."""
    serve_config: str = "configs/serve/tiny_cpu.yaml"
    """Serving YAML the app is rendered from (relative paths: from the working directory, then the project)."""
    serve_overrides: list[str] = field(default_factory=list)
    """`key=value` overrides applied to the serving config."""
    target: Literal["local", "kubernetes"] = "local"
    dashboard_url: str = ""
    """Ray dashboard for `target: local`; "" = RAY_ADDRESS (when an http URL), else http://127.0.0.1:8265."""
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    deploy_timeout_s: float = 900.0
    """How long the new replicas may take to become healthy before the rollout is rolled back."""
    smoke_timeout_s: float = 120.0
    """How long, once healthy, until a smoke request must be answered by the new version."""
    smoke_prompt: str = "Hello"
    fail_fast: bool = True
    """Roll back on the first failed start of a new replica instead of waiting out Serve's retries."""
    rollback_alias: bool = True
    """After a refusal or a failed rollout, point the alias back at the version still being served."""
    experiment: str = "rayline-rollout"
    """MLflow experiment of the rollout runs."""
    triggered_by: str = ""
    """Recorded as `rollout.triggered_by`; "" = ray-job:<id>, or cli:<user>@<host>."""
    watch: bool = False
    """Keep following the alias: poll every `poll_interval_s`, and react at once to webhook calls."""
    poll_interval_s: float = 15.0
    max_rollouts: int = 0
    """In watch mode, stop after this many rollout attempts (0 = run until stopped)."""
    webhook_port: int = 0
    """Port of the MLflow webhook receiver in watch mode (0 = none)."""
    webhook_host: str = "127.0.0.1"
    webhook_path: str = "/mlflow-webhook"
    webhook_secret_env: str = "RAYLINE_WEBHOOK_SECRET"
    """Environment variable holding the webhook's HMAC secret (unset: signatures are not checked)."""
    register_webhook: bool = False
    """Create the `model_version_alias.created` webhook in MLflow at start (watch mode)."""
    webhook_url: str = ""
    """URL MLflow calls; "" = http://<webhook_host>:<webhook_port><webhook_path>."""

    def __post_init__(self) -> None:
        require(bool(self.alias.strip()), "alias", "must name an MLflow alias, e.g. champion")
        require(bool(self.serve_config.strip()), "serve_config", "must name the serving YAML, e.g. configs/serve/tiny_cpu.yaml")
        require(self.deploy_timeout_s > 0 and self.smoke_timeout_s > 0, "deploy_timeout_s", "timeouts must be > 0")
        require(self.poll_interval_s > 0, "poll_interval_s", f"must be > 0, got {self.poll_interval_s}")
        require(self.max_rollouts >= 0, "max_rollouts", f"must be >= 0, got {self.max_rollouts}")
        require(0 <= self.webhook_port < 65536, "webhook_port", f"must be a TCP port or 0, got {self.webhook_port}")
        require(self.webhook_path.startswith("/"), "webhook_path", f"must start with '/', got {self.webhook_path!r}")
        if self.target == "kubernetes":
            require(bool(self.kubernetes.name), "kubernetes.name", "must name the RayService when target is kubernetes")
            require(bool(self.kubernetes.serve_url), "kubernetes.serve_url",
                    "must give the OpenAI base URL of the RayService for the smoke request")


# rayjobs/stages.py names the rollout config class this way.
RolloutConfig = Config
