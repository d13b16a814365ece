"""The Kubernetes side of a deployment: image, namespace, secrets, pod sizes, accelerators, network peers.

A stage config says *what* to run and how many workers/GPUs it needs; this profile says *where*:
`configs/k8s/default.yaml` mirrors `Profile`. Secrets are only ever referenced by name (secretKeyRef or a
Secret volume), never inlined.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from core.config import ConfigError, require

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
    """Read/write object-store Secret of the jobs: keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. None: the
    pods get their access another way (e.g. workload identity)."""
    s3_read_only: str | None = "rayline-s3-read-only"
    """The same keys for a read-only identity: serving pods only read the model they serve."""
    mlflow_prefix: str | None = "rayline-mlflow"
    """Each role's MLflow login is the Secret `<prefix>-<role>` (type kubernetes.io/basic-auth: username, password),
    mounted as files, never as env values; roles: trainer, evaluator, rollout, reader. None: no login."""
    hf: str | None = "rayline-hf"
    """Secret with key HF_TOKEN (optional)."""
    openai_keys: str | None = "rayline-openai-keys"
    """Serving pods' Secret with key `keys.json`: the hashed OpenAI API keys the app accepts."""
    openai_admin_key: str | None = "rayline-openai-admin-key"
    """The rollout's Secret with key `admin_key`: the admin API key its smoke requests, canary probes and stats send
    (serve/promotion/verify.py `admin_key`; its hash is an `admin` entry of `keys.json`). None: the rollout gets none and stops
    before it deploys anything."""
    mlflow_webhook: str | None = "rayline-mlflow-webhook"
    """The rollout's Secret with key `secret`: the HMAC secret MLflow signs webhook deliveries with. Mounted only when
    the rendered rollout config sets `webhook_port`."""

    def __post_init__(self):
        require(self.s3 is None or self.s3_read_only != self.s3, "s3_read_only",
                f"must name a Secret other than s3 ({self.s3!r}): serving pods must not hold the jobs' write access")
        require(self.openai_admin_key is None or self.openai_admin_key != self.openai_keys, "openai_admin_key",
                f"must name a Secret other than openai_keys ({self.openai_keys!r}): serving pods mount that one and "
                "must not hold the admin key")


# Private and link-local IPv4 ranges: the cluster's pods and Services, and the cloud metadata endpoint (169.254.169.254).
PRIVATE_CIDRS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16")


@dataclass
class Peer:
    """The other side of a flow: pods labelled `pod_labels` in `namespace` (None: any namespace), or addresses.

    For a destination, `ports` are the ports its pods listen on: a NetworkPolicy matches the pod's port, not a
    Service's."""

    namespace: str | None = None
    pod_labels: dict[str, str] = field(default_factory=dict)
    cidrs: list[str] = field(default_factory=list)
    except_cidrs: list[str] = field(default_factory=list)
    """Carved out of `cidrs` (each must lie inside one of them)."""
    ports: list[int] = field(default_factory=list)

    def __post_init__(self):
        by_pods = self.namespace is not None or bool(self.pod_labels)
        require(by_pods != bool(self.cidrs), "cidrs",
                "give either cidrs or namespace/pod_labels (one kind of peer per flow)")
        nets = [self._network("cidrs", c) for c in self.cidrs]
        for c in self.except_cidrs:
            inner = self._network("except_cidrs", c)
            require(any(inner.version == n.version and inner.subnet_of(n) for n in nets), "except_cidrs",
                    f"{c} lies inside none of cidrs {self.cidrs}")
        require(all(0 < p < 65536 for p in self.ports), "ports", f"must be TCP/UDP ports, got {self.ports}")

    @staticmethod
    def _network(name: str, cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        try:
            return ipaddress.ip_network(cidr)
        except ValueError as e:
            raise ConfigError(f"{name}: {cidr!r} is not a CIDR ({e})") from None


@dataclass
class Network:
    """Where the flows rayline's pods need go (rayjobs/network_policy.py); everything else is denied."""

    dns: Peer = field(default_factory=lambda: Peer("kube-system", {"k8s-app": "kube-dns"}, ports=[53]))
    object_store: Peer = field(default_factory=lambda: Peer(cidrs=["0.0.0.0/0"], except_cidrs=list(PRIVATE_CIDRS),
                                                            ports=[443]))
    """AWS S3 by default: any public address (S3's are not fixed), never a private or link-local one, so this rule
    opens neither the cluster's own Services (the API server's included) nor the cloud's metadata endpoint.
    An in-cluster store: its namespace and pod labels."""
    mlflow: Peer = field(default_factory=lambda: Peer("mlflow", ports=[5000]))
    gateway: Peer = field(default_factory=lambda: Peer("ingress-nginx"))
    """Who may reach the serving pods' port 8000 (the ingress controller or gateway in front of them)."""
    prometheus: Peer = field(default_factory=lambda: Peer("monitoring", {"app.kubernetes.io/name": "prometheus"},
                                                          ports=[9090]))
    """Scrapes the metrics port (8080); `ports`: its query API, which the rollout's canary reads."""
    kuberay_operator: Peer = field(default_factory=lambda: Peer(pod_labels={"app.kubernetes.io/name": "kuberay-operator"}))
    """Reaches each head's dashboard (8265: job and Serve status) and Serve port (8000: proxy health)."""
    kube_api: Peer = field(default_factory=lambda: Peer(cidrs=["0.0.0.0/0"], except_cidrs=["169.254.0.0/16"],
                                                        ports=[443, 6443]))
    """The API server, for the rollout and autoscaler containers only. CNIs differ on whether they see the Service
    port (443) or the endpoint's (6443); narrow the CIDR to your control plane's. Never the metadata endpoint."""

    def __post_init__(self):
        for name in ("dns", "object_store", "mlflow", "prometheus", "kube_api"):
            require(bool(getattr(self, name).ports), f"{name}.ports", "a destination needs the ports its pods listen on")


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
    image_digest: str | None = None
    """`sha256:<64 hex>`: pods pull `image@<digest>`, so a re-pushed tag cannot change what runs. None: the tag."""
    working_dir: str | None = None
    """Remote working_dir for jobs (e.g. s3://bucket/rayline.zip); None when the code is in the image."""
    code_dir: str = "/home/ray/rayline"
    """Where the image holds the project (the job's cwd when working_dir is None)."""
    mlflow_tracking_uri: str = "http://mlflow.mlflow.svc.cluster.local:5000"
    s3_endpoint: str | None = None
    """AWS_ENDPOINT_URL for a non-AWS object store; None on AWS."""
    secrets: SecretRefs = field(default_factory=SecretRefs)
    run_as_user: int = 1000
    run_as_group: int = 100
    """The image's non-root user and group (rayproject images: `ray`, uid 1000, gid 100)."""
    home_dir: str = "/home/rayline"
    """HOME of every container: a writable emptyDir, since the root filesystem is read-only (Hugging Face, vLLM,
    Triton and rayline's model caches live under it). Must not hide `code_dir`."""
    network: Network = field(default_factory=Network)
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
        require(self.image_digest is None or re.fullmatch(r"sha256:[0-9a-f]{64}", self.image_digest) is not None,
                "image_digest", f"must be sha256:<64 lowercase hex digits>, got {self.image_digest!r}")
        require(self.run_as_user > 0, "run_as_user", "must be a non-root uid (> 0)")
        require(self.home_dir.startswith("/") and not (self.code_dir + "/").startswith(self.home_dir.rstrip("/") + "/"),
                "home_dir", f"must be an absolute path that does not contain code_dir ({self.code_dir})")
        self._check_port("mlflow_tracking_uri", "mlflow")
        if self.s3_endpoint:
            self._check_port("s3_endpoint", "object_store")

    def _check_port(self, name: str, peer: str) -> None:
        """The port the URL `name` names must be one `network.<peer>` lets pods reach, or every call would time out."""
        url, ports = getattr(self, name), getattr(self.network, peer).ports
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        require(port in ports, name, f"{url} uses port {port}, which network.{peer}.ports ({ports}) does not allow; "
                                     "add it there")

    @property
    def image_ref(self) -> str:
        """What pods pull: the image, pinned to its digest when the profile gives one."""
        return f"{self.image}@{self.image_digest}" if self.image_digest else self.image
