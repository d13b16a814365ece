"""The Kubernetes side of a deployment: image, namespace, secrets, pod sizes, accelerators.

A stage config says *what* to run and how many workers/GPUs it needs; this profile says *where*:
`configs/k8s/default.yaml` mirrors `Profile`. Secrets are only ever referenced by name
(secretKeyRef), never inlined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipelines.config import require

RAY_VERSION = "2.60.0"


@dataclass
class PodSize:
    cpu: str = "4"
    memory: str = "16Gi"


@dataclass
class GpuNodes:
    gpus_per_pod: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    accelerator_type: str = "H100"
    """GPU type of stages that name none (training)."""
    node_selectors: dict[str, dict[str, str]] = field(default_factory=lambda: {
        "H100": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "H200": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "A100": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "L4": {"nvidia.com/gpu.product": "NVIDIA-L4"},
    })
    """Ray accelerator type (what an engine's `accelerator_type` says) -> the node labels of such GPUs."""
    tolerations: list[dict[str, str]] = field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
    gpu_memory_gib: int = 80

    def node_selector(self, accelerator_type: str | None) -> dict[str, str]:
        kind = accelerator_type or self.accelerator_type
        require(kind in self.node_selectors, "gpu.node_selectors",
                f"no node selector for accelerator type {kind!r} (known: {', '.join(sorted(self.node_selectors))})")
        return dict(self.node_selectors[kind])


@dataclass
class SecretRefs:
    s3: str | None = "rayline-s3"
    """Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."""
    mlflow: str | None = "rayline-mlflow"
    """Secret with keys MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (optional)."""
    hf: str | None = "rayline-hf"
    """Secret with key HF_TOKEN (optional)."""


@dataclass
class Autoscaling:
    """Ray's in-tree autoscaler (autoscaler v2) on the rendered clusters: it adds worker pods while tasks,
    actors or Serve replicas wait for resources and removes pods idle for `idle_timeout_s`. A RayService
    autoscales when its serve config's `autoscaling.min_replicas` is below `max_replicas`; a RayJob when `jobs`
    is on."""

    jobs: bool = False
    """RayJobs start with `min_job_workers` worker pods and grow to what the stage needs as it asks;
    off: the job's cluster is created at full size."""
    min_job_workers: int = 0
    idle_timeout_s: int = 60
    """Seconds an idle worker pod is kept before the autoscaler removes it (`idleTimeoutSeconds`)."""
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = "Default"
    """How fast pods are added: Default/Aggressive add what is pending at once; Conservative rate-limits
    (KubeRay's `upscalingMode`)."""

    def __post_init__(self):
        require(self.min_job_workers >= 0, "autoscaling.min_job_workers", f"must be >= 0, got {self.min_job_workers}")
        require(self.idle_timeout_s >= 0, "autoscaling.idle_timeout_s", f"must be >= 0, got {self.idle_timeout_s}")


@dataclass
class GcsFaultTolerance:
    """GCS fault tolerance for RayServices: the head's GCS keeps its state in an external Redis, so a restarted
    GCS or head pod gets the cluster's actors, placement groups and Serve apps back while the worker pods go
    on serving. RayJobs' clusters live for one job and do without."""

    redis_address: str | None = None
    """`host:port` of the Redis; None: off."""
    password_secret: str | None = "rayline-redis"
    """The Secret with the Redis password (key `password_key`); None: a Redis without a password."""
    password_key: str = "password"
    external_storage_namespace: str | None = None
    """Keeps several clusters apart in one Redis; None: KubeRay's default (the RayCluster's UID)."""

    def __post_init__(self):
        if self.redis_address is not None:
            host, _, port = self.redis_address.rpartition(":")
            require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "gcs_fault_tolerance.redis_address",
                    f"must be host:port (e.g. redis.rayline.svc:6379), got {self.redis_address!r}")


@dataclass
class Profile:
    namespace: str = "rayline"
    image: str = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"
    """Must carry Ray {RAY_VERSION} and rayline's code + dependencies (see README, 'Images')."""
    service_account: str = "rayline"
    working_dir: str | None = None
    """Remote working_dir for jobs (e.g. s3://bucket/rayline.zip); None when the code is in the image."""
    code_dir: str = "/home/ray/rayline"
    """Where the image holds the project (the job's cwd when working_dir is None)."""
    mlflow_tracking_uri: str = "http://mlflow.mlflow.svc.cluster.local:5000"
    s3_endpoint: str | None = None
    """AWS_ENDPOINT_URL for a non-AWS object store; None on AWS."""
    secrets: SecretRefs = field(default_factory=SecretRefs)
    head: PodSize = field(default_factory=lambda: PodSize("2", "8Gi"))
    cpu_worker: PodSize = field(default_factory=lambda: PodSize("8", "32Gi"))
    max_cpu_workers: int = 8
    gpu: GpuNodes = field(default_factory=GpuNodes)
    shm_size: str = "16Gi"
    ttl_seconds_after_finished: int = 3600
    active_deadline_seconds: int = 86400
    submission_mode: Literal["K8sJobMode", "HTTPMode"] = "K8sJobMode"
    submitter_backoff_limit: int = 2
    kueue_queue: str | None = None
    """When set, jobs carry `kueue.x-k8s.io/queue-name` and start suspended for Kueue to admit."""
    upgrade_strategy: Literal["NewCluster", "NewClusterWithIncrementalUpgrade", "None"] = "NewCluster"
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    gcs_fault_tolerance: GcsFaultTolerance = field(default_factory=GcsFaultTolerance)

    def __post_init__(self):
        require(RAY_VERSION in self.image.rsplit(":", 1)[-1], "image",
                f"{self.image!r}: the tag must carry the pinned Ray {RAY_VERSION} (e.g. rayproject/ray:{RAY_VERSION}-py311)")
        require(self.ttl_seconds_after_finished >= 0, "ttl_seconds_after_finished", "must be >= 0")
        require(self.active_deadline_seconds > 0, "active_deadline_seconds", "must be > 0")
        require(self.submitter_backoff_limit >= 0, "submitter_backoff_limit", "must be >= 0")
