"""The rollout config: which alias to follow, the gate a version must pass, where and how to deploy it.

    python -m pipelines.rollout --model rayline-tiny [--alias champion] [--watch] [--config configs/rollout/tiny.yaml] [key=value ...]

The serving side (engine, placement, autoscaling) is not repeated here: `serve_config` names the
serving YAML (serve/online/serve_config.py) that the app is rendered from, with `serve_overrides` on top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from core.config import require
from core.registry import DEFAULT_ALIAS


@dataclass
class GateConfig:
    """What a version must show before it is deployed; a failing version is refused and tagged with why."""

    min_metrics: dict[str, float] = field(default_factory=lambda: {"eval.exact_match": 0.5})
    """`eval.<metric>` -> lowest acceptable value of that metric on the batch stage's eval run of exactly the
    version's bytes (serve/promotion/gate.py `eval_figures`; tags do not count). A missing figure fails the gate."""
    max_metrics: dict[str, float] = field(default_factory=dict)
    """`eval.<metric>` -> highest acceptable value (e.g. an error rate)."""
    eval_experiment: str = "rayline-eval"
    """The MLflow experiment the evaluator identity writes its eval runs to (the batch config's mlflow_experiment);
    on an MLflow with authentication, only the evaluator (and admin) may write it."""
    check_artifacts: bool = True
    """Require a complete checkpoint: config.json, tokenizer, every weight shard whole (safetensors headers)."""


@dataclass
class CanaryConfig:
    """Champion and challenger (serve/promotion/canary.py): a version with the `alias` below takes a growing share of live
    traffic beside the champion, is judged on each step's live metrics and a quality probe, and becomes champion
    or is rolled back. Off while `steps` is empty."""

    alias: str = "challenger"
    steps: list[float] = field(default_factory=list)
    """Shares of live requests the challenger takes (split) or gets a copy of (shadow), one step each, e.g. [0.05, 0.25, 0.5]."""
    step_s: float = 60.0
    """How long each step runs before it is judged."""
    mode: Literal["split", "shadow"] = "split"
    """split: the challenger answers its share; shadow: it answers copies, and clients only ever get the champion's."""
    sticky_header: str = ""
    """Request header whose value keeps a client on one version. Without it (or "" here): the body's `user`, else the
    chat's opening messages, so a conversation stays on one version either way."""
    route_prefix: str = ""
    """Route of the challenger's own Serve app; "" = <the serving config's route_prefix>/-challenger."""
    min_requests: int = 5
    """Live challenger requests a step needs to be judged; fewer -> the step fails (no evidence is no pass)."""
    max_error_ratio: float = 0.01
    """The challenger's share of failed live requests may not exceed this (nor the champion's by more than it)."""
    max_ttft_p50_ratio: float = 1.5
    max_ttft_p99_ratio: float = 2.0
    max_itl_ratio: float = 1.5
    """Challenger / champion ratios of TTFT p50 and p99 and mean inter-token latency, above which the step fails."""
    latency_slack_s: float = 0.05
    """Added to the champion's figure before a latency ratio is applied (loopback latencies of a few ms are noise)."""
    probe_uri: str = ""
    """JSONL of chat records whose last message is the known answer (an eval split); "" = no quality probe."""
    probe_size: int = 8
    probe_max_tokens: int = 16
    max_quality_drop: float = 0.1
    """The challenger's probe exact match may be at most this below the champion's."""
    metrics: Literal["auto", "prometheus", "replicas"] = "auto"
    """Where a step's live figures come from. prometheus: every champion replica's, from `prometheus_url`
    (serve/promotion/canary_metrics.py); replicas: the replicas' own stats route, which answers for the one replica a request
    reaches (the whole truth only for a one-replica champion); auto: prometheus when a URL is known, else replicas."""
    prometheus_url: str = ""
    """The Prometheus that scrapes the champion's replicas; "" = $RAYLINE_PROMETHEUS_URL (the local stack sets it)."""
    metrics_lag_s: float = 20.0
    """With prometheus: how long after a moment Prometheus holds what was recorded before it (the replicas' 2 s
    report interval + the scrape interval + margin). Each step's window is read this much later, so a step takes
    `step_s` + `metrics_lag_s`; keep `step_s` several scrape intervals long."""

    def __post_init__(self) -> None:
        require(all(0 < s <= 1 for s in self.steps), "canary.steps", f"shares must be within (0, 1], got {self.steps}")
        require(list(self.steps) == sorted(self.steps), "canary.steps", f"must not decrease, got {self.steps}")
        require(self.step_s > 0, "canary.step_s", f"must be > 0, got {self.step_s}")
        require(self.mode in ("split", "shadow"), "canary.mode", f"must be split or shadow, got {self.mode!r}")
        require(self.min_requests >= 0 and self.probe_size >= 0, "canary.min_requests", "counts must be >= 0")
        require(not self.route_prefix or self.route_prefix.startswith("/"), "canary.route_prefix",
                f"must start with '/', got {self.route_prefix!r}")
        require(self.metrics in ("auto", "prometheus", "replicas"), "canary.metrics",
                f"must be auto, prometheus or replicas, got {self.metrics!r}")
        require(self.metrics_lag_s >= 0, "canary.metrics_lag_s", f"must be >= 0, got {self.metrics_lag_s}")
        require(not self.prometheus_url or self.prometheus_url.startswith(("http://", "https://")),
                "canary.prometheus_url", f"must be an http(s) URL, got {self.prometheus_url!r}")

    def metrics_url(self) -> str:
        """The Prometheus a step is judged from; "" = the replicas' own stats."""
        if self.metrics == "replicas":
            return ""
        url = self.prometheus_url or os.environ.get("RAYLINE_PROMETHEUS_URL", "")
        require(bool(url) or self.metrics == "auto", "canary.prometheus_url",
                "canary.metrics is prometheus, but no URL is set here or in RAYLINE_PROMETHEUS_URL")
        return url


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
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    """With `canary.steps`, a version with the `canary.alias` (challenger) is rolled out gradually beside `alias`."""
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
    webhook_secret_file: str = ""
    """File holding the HMAC secret MLflow signs webhook deliveries with (on Kubernetes, a Secret mounted as a file);
    "" = $RAYLINE_WEBHOOK_SECRET_FILE (`python -m pipelines.stack env` names the local stack's). Required with
    `webhook_port`: the receiver refuses unsigned deliveries and does not start without it."""
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

    def webhook_secret(self) -> str:
        """The webhook's HMAC secret, read from `webhook_secret_file` (or $RAYLINE_WEBHOOK_SECRET_FILE); a
        ConfigError naming the field and the file when there is none."""
        from core.config import ConfigError
        from core.secret_files import read_secret

        path = self.webhook_secret_file or os.environ.get("RAYLINE_WEBHOOK_SECRET_FILE", "")
        require(bool(path), "webhook_secret_file", f"webhook_port={self.webhook_port} needs the secret MLflow signs "
                "deliveries with: name a file holding it here or in RAYLINE_WEBHOOK_SECRET_FILE (the local stack's "
                "is <state dir>/credentials/webhook_secret)")
        try:
            secret = read_secret(path)
        except OSError as e:
            raise ConfigError(f"webhook_secret_file: cannot read {path}: {e.strerror}") from None
        require(bool(secret), "webhook_secret_file", f"{path} is empty")
        return secret


# rayjobs/stages.py names the rollout config class this way.
RolloutConfig = Config
