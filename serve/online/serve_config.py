"""The serving config: one dataclass -> the Ray Serve LLM app, its `serve deploy` file and a RayService's serveConfigV2.

    python -m pipelines.serve --config configs/serve/tiny_cpu.yaml [key=value ...]

The YAML mirrors `Config` (the engine part is `serve.online.engine.EngineConfig`). `engine.model` is the model
reference, normally an MLflow alias (`models:/rayline-tiny@champion`); deploying resolves it to one
version and pins that version in the rendered app, so what runs is explicit and a rollback is a redeploy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlparse

from core.config import require
from core.node_labels import check_node_labels
from serve.online.engine import VLLM_LORA_RANKS, EngineConfig
from serve.online.routing_config import RoutingConfig


@dataclass
class AutoscalingConfig:
    """Replicas of the engine deployment (Ray Serve `autoscaling_config`)."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    """Replicas at deploy time; None = min_replicas."""
    target_ongoing_requests: float = 32.0
    """Requests per replica (queued + running) the autoscaler steers towards."""
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    look_back_period_s: float | None = None
    """Seconds of replica load the autoscaler averages over; None = Ray Serve's default (30). A replica leaves
    no sooner than this plus downscale_delay_s after its load ends."""
    metrics_interval_s: float | None = None
    """How often replicas and handles push their load to the autoscaler; None = Ray Serve's default (10). Keep it
    below look_back_period_s: a 4 s look-back with 10 s pushes sees a queue up to 10 s late (Serve warns)."""

    def __post_init__(self) -> None:
        require(self.min_replicas >= 0, "autoscaling.min_replicas", f"must be >= 0, got {self.min_replicas}")
        require(self.max_replicas >= max(1, self.min_replicas), "autoscaling.max_replicas",
                f"must be >= 1 and >= min_replicas ({self.min_replicas}), got {self.max_replicas}")
        if self.initial_replicas is not None:
            require(self.min_replicas <= self.initial_replicas <= self.max_replicas, "autoscaling.initial_replicas",
                    f"must lie in [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        require(self.target_ongoing_requests > 0, "autoscaling.target_ongoing_requests", "must be > 0")
        require(self.upscale_delay_s >= 0 and self.downscale_delay_s >= 0, "autoscaling.upscale_delay_s",
                "delays must be >= 0 seconds")
        require(self.look_back_period_s is None or self.look_back_period_s > 0, "autoscaling.look_back_period_s",
                f"must be > 0 seconds or null, got {self.look_back_period_s}")
        require(self.metrics_interval_s is None or self.metrics_interval_s > 0, "autoscaling.metrics_interval_s",
                f"must be > 0 seconds or null, got {self.metrics_interval_s}")

    def to_serve(self) -> dict[str, Any]:
        """The `autoscaling_config` dict Ray Serve takes."""
        out: dict[str, Any] = {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
        }
        if self.initial_replicas is not None:
            out["initial_replicas"] = self.initial_replicas
        if self.look_back_period_s is not None:
            out["look_back_period_s"] = self.look_back_period_s
        if self.metrics_interval_s is not None:
            out["metrics_interval_s"] = self.metrics_interval_s
        return out


ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class LoraServingConfig:
    """LoRA adapters served by the same replicas as the base (issue 18). Clients name one as
    `<served_model_id>:<name>` (Ray Serve LLM's convention); each response's `model` names the adapter version
    that answered. The set is applied to running replicas in place (the deployment's `user_config`): a new
    adapter version is loaded beside the old one and takes the name once it is loaded, with no engine restart."""

    adapters: dict[str, str] = field(default_factory=dict)
    """Client name -> adapter reference, normally an alias (`arith: models:/rayline-tiny-arith@champion`);
    deploying pins each to one version, checked against the base first."""
    max_adapters: int = 0
    """Adapters one replica can serve at once; 0 = as many as `adapters` lists (LoRA is off with none). It is fixed
    when the engine starts: more adapters later need a restart."""
    max_lora_rank: int = 16
    """The largest adapter rank the engines accept (one of vLLM's: 1, 8, 16, 32, 64, 128, 256, 320, 512)."""

    def __post_init__(self) -> None:
        for name, ref in self.adapters.items():
            require(bool(ADAPTER_NAME.match(str(name))), f"lora.adapters.{name}",
                    "an adapter name is letters, digits, '.', '_' or '-' (clients send `<served_model_id>:<name>`)")
            require(isinstance(ref, str) and bool(ref.strip()), f"lora.adapters.{name}", "must name an adapter")
        require(self.max_adapters >= 0, "lora.max_adapters", f"must be >= 0, got {self.max_adapters}")
        require(self.max_adapters == 0 or self.max_adapters >= len(self.adapters), "lora.max_adapters",
                f"{self.max_adapters} is fewer than the {len(self.adapters)} adapters listed")
        require(self.max_lora_rank in VLLM_LORA_RANKS, "lora.max_lora_rank",
                f"must be one of {list(VLLM_LORA_RANKS)} (vLLM's), got {self.max_lora_rank}")

    @property
    def slots(self) -> int:
        """Adapters a replica serves (0: LoRA off)."""
        return self.max_adapters or len(self.adapters)

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's LoRA arguments: one batch slot more than `slots` and twice the adapters in CPU memory, so a new
        version loads beside the one it replaces while that one finishes its requests."""
        if not self.slots:
            return {}
        return {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": self.slots + 1,
                "max_cpu_loras": 2 * self.slots + 1}


@dataclass
class AuthConfig:
    """Who may call the app's routes, and how much (serve/online/api_auth.py). Always on: every route but the liveness probes
    needs an API key (`Authorization: Bearer <key>`); there is no setting that turns keys off."""

    keys_file: str = ""
    """The JSON file of the keys' sha256 hashes, roles and limits (core/api_keys.py), read by each replica on its
    own node and read again when it changes; "" = $RAYLINE_API_KEYS_FILE of the Ray processes (the local stack sets
    it). On Kubernetes: the Secret rayline-openai-keys mounted at /var/run/secrets/rayline/openai (keys.json)."""
    admin_key_file: str = ""
    """The admin key rayline's own requests to the app send (the rollout's smoke requests, the canary's probe and
    stats); "" = $RAYLINE_ADMIN_KEY_FILE of the process that runs the rollout."""
    max_body_bytes: int = 2**20
    """Largest request body; larger ones get 413."""
    max_n: int = 8
    """Largest `n` (and `best_of`) of a request; more gets 400."""
    max_tokens: int = 4096
    """Largest `max_tokens` (`max_completion_tokens`, `max_output_tokens`) of a request; more gets 400."""

    def __post_init__(self) -> None:
        require(not self.keys_file or os.path.isabs(self.keys_file), "auth.keys_file",
                f"must be an absolute path (each replica reads it on its own node), got {self.keys_file!r}")
        require(self.max_body_bytes >= 1024, "auth.max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        require(self.max_n >= 1, "auth.max_n", f"must be >= 1, got {self.max_n}")
        require(self.max_tokens >= 1, "auth.max_tokens", f"must be >= 1, got {self.max_tokens}")


@dataclass
class Config:
    engine: EngineConfig
    """vLLM engine, placement and model reference (`engine.model`), shared with batch inference."""
    app_name: str = "rayline"
    """Ray Serve application name; the rollout updates this application."""
    route_prefix: str = "/"
    served_model_id: str = "rayline"
    """The `model` clients send. Stays the same across versions; the version is in `system_fingerprint`."""
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)
    max_ongoing_requests: int = 256
    """Requests one engine replica holds at once (the engine queues beyond max_num_seqs)."""
    max_surge_percent: int = 100
    """Extra replicas during a rolling update; 100 starts every new replica before an old one stops (no gap)."""
    ingress: Literal["engine", "deployment"] = "engine"
    """Who serves the OpenAI routes. `engine`: each engine replica serves vLLM's own OpenAI app (Serve's proxy ->
    the replica -> its engine; what Ray's direct streaming builds, without HAProxy): one hop and one process per
    token fewer. `deployment`: Ray's `build_openai_app` layout, a separate OpenAI ingress deployment that calls
    the engine replicas through handles; the ingress scales apart from the engines (`ingress_replicas`). Adapters
    and canaries work in both."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """How Serve picks the engine replica for a request: Serve's power of two, or Ray Serve LLM's prefix-cache
    affinity (needs `ingress: deployment`; serve/online/routing_config.py)."""
    node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the engine replicas must land on, in Ray's label-selector syntax (`value`, `!value`,
    `in(a,b)`, `!in(a,b)`), e.g. `{"rayline.io/node": "in(worker-1,worker-2)"}` on the local stack or a KubeRay
    worker group's labels; {} = any node. Passed to Serve as the replicas' placement-group bundle label selector."""
    ingress_cpus: float = 0.1
    """Logical CPUs of the OpenAI ingress replica (ingress: deployment); fractional so it fits beside the engines."""
    ingress_replicas: int = 1
    """Ingress replicas (ingress: deployment)."""
    stream_batching_interval_ms: float | None = None
    """How long the engine replica gathers streamed tokens before handing them to the ingress deployment (ingress:
    deployment); None = Ray's default (50)."""
    log_engine_metrics: bool = True
    """Export the engine's metrics (TTFT, TPOT, KV cache use) through Ray's metrics system (Ray's default). It
    records through `ray.util.metrics` on every engine step, in the replica's event loop; off, vLLM's own
    Prometheus metrics remain (no throughput difference measured on 2 cores, within the machine's drift)."""
    request_metrics: bool = True
    """Count each HTTP response in `rayline_serve_requests_total` by served version and status code (an ASGI
    middleware on the engine replica that reads only the response's start; bench/bench_serve_metrics.py
    measures what it costs)."""
    access_log: bool = False
    """Serve access log lines per request (off: they cost CPU on every request)."""
    health_check_period_s: float = 2.0
    """How often Serve's controller checks each engine replica (`check_health`: the engine has not failed). A replica
    whose node is lost fails its next check at once (its actor is unreachable), and is then marked down, removed
    from every node's HAProxy and replaced: this period bounds that time (Ray's default, 10 s, let a lost replica
    stay listed up to 11 s; Ray's own node health check, 3 s x 5 failures, takes longer still). One small RPC per
    replica per period."""
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 30.0
    """How long a retiring replica may finish its in-flight requests."""
    max_wait_s: float = 0.0
    """Seconds a deploy may wait for its replicas to be placed for cluster resources before it fails with the wait's report (what it asked for,
    what is free, what holds the rest, whether an autoscaler can add nodes: core/resource_wait.py); 0 = wait as
    long as it takes (the report is printed all the same, 10 s into a wait and every minute after)."""
    http_host: str = "127.0.0.1"
    """Where Serve's HTTP proxy listens: loopback locally, 0.0.0.0 in a pod."""
    http_port: int = 0
    """Serve's HTTP port; 0 = the local stack's (from RAYLINE_SERVE_URL), else 8000."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Application runtime_env (on a cluster: working_dir, env_vars such as MLFLOW_TRACKING_URI)."""
    model_cache_dir: str = ""
    """Where MLflow-artifact checkpoints are downloaded; "" = ~/.cache/rayline/models."""
    lora: LoraServingConfig = field(default_factory=LoraServingConfig)
    """LoRA adapters of the base served by the same engine replicas (either ingress)."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """API keys, their limits and the request caps of every route (serve/online/api_auth.py)."""

    def __post_init__(self) -> None:
        require(bool(self.app_name.strip()), "app_name", "must not be empty")
        require(self.route_prefix.startswith("/"), "route_prefix", f"must start with '/', got {self.route_prefix!r}")
        require(bool(self.served_model_id.strip()), "served_model_id", "must not be empty (clients send it as `model`)")
        require(self.max_ongoing_requests >= 1, "max_ongoing_requests", f"must be >= 1, got {self.max_ongoing_requests}")
        require(0 <= self.max_surge_percent <= 100, "max_surge_percent", f"must be in [0, 100], got {self.max_surge_percent}")
        check_node_labels(self.node_labels, "node_labels")
        require(self.ingress_cpus >= 0, "ingress_cpus", f"must be >= 0, got {self.ingress_cpus}")
        require(self.max_wait_s >= 0, "max_wait_s", f"must be >= 0 (0 = no limit), got {self.max_wait_s}")
        require(self.ingress_replicas >= 1, "ingress_replicas", f"must be >= 1, got {self.ingress_replicas}")
        require(self.stream_batching_interval_ms is None or self.stream_batching_interval_ms >= 0,
                "stream_batching_interval_ms", "must be >= 0 or null")
        require(0 <= self.http_port < 65536, "http_port", f"must be a TCP port or 0, got {self.http_port}")
        require(self.health_check_period_s > 0 and self.health_check_timeout_s > 0, "health_check_period_s",
                "health check period and timeout must be > 0")
        require(self.routing.policy == "power_of_two" or self.ingress == "deployment", "routing.policy",
                f"{self.routing.policy} routes by the prompt a handle call carries: set ingress: deployment (with "
                "ingress: engine, HTTP reaches the replicas through Serve's proxy, which carries no prompt)")
        require(":" not in self.served_model_id or not self.lora.slots, "served_model_id",
                "must not contain ':' when adapters are served (clients send `<served_model_id>:<adapter>`)")

    def resolved_http_port(self) -> int:
        """`http_port`, or the local stack's Serve port (RAYLINE_SERVE_URL), or 8000."""
        if self.http_port:
            return self.http_port
        url = os.environ.get("RAYLINE_SERVE_URL", "")
        return (urlparse(url).port if url else None) or 8000

    def base_url(self) -> str:
        """Where clients reach the OpenAI API of this app from this machine."""
        host = "127.0.0.1" if self.http_host in ("0.0.0.0", "::", "") else self.http_host
        return f"http://{host}:{self.resolved_http_port()}{self.route_prefix.rstrip('/')}/v1"


# rayjobs/stages.py names the serving config class this way.
ServeConfig = Config
