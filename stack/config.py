"""The local stack's config: which parts run, on which ports, with what resources (`python -m pipelines.stack up
key=value ...` sets any field; stack/lifecycle.py starts what it describes)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from core.config import require

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SERVE_REPLICA_PORTS = ((30000, 31000), (40000, 41000))
"""Ray Serve 2.60's direct-ingress port ranges (HTTP, gRPC) on each node (RAY_SERVE_DIRECT_INGRESS_MIN/MAX_*)."""


@dataclass
class StackConfig:
    state_dir: str = ".rayline"
    """Where pids, logs, the MLflow store, the Ray token and Swift data live (relative to the project root)."""
    ray_port: int = 6379
    dashboard_port: int = 8265
    """Ray dashboard and Jobs API (`ray job submit --address http://127.0.0.1:<port>`)."""
    ray_client_port: int = 10001
    dashboard_agent_port: int = 52365
    min_worker_port: int = 10002
    max_worker_port: int = 19999
    """Ports Ray workers take; two stacks on one machine need disjoint ranges (and the other ports)."""
    serve_port: int = 8000
    """Where Ray Serve's HTTP proxy listens once an application is deployed."""
    num_cpus: int = 0
    """Logical CPUs for the Ray head; 0 = the machine's core count."""
    mlflow_port: int = 5000
    s3: bool = False
    """Also run the Swift S3-compatible store."""
    s3_port: int = 8080
    memcached_port: int = 11211
    bucket: str = "rayline"
    """Bucket created at start when s3 is on."""
    prometheus: bool = True
    """Also run Prometheus, scraping every Ray node, MLflow and itself; skipped, with the reason, where the
    `prometheus` package is not installed."""
    prometheus_port: int = 9095
    """Not 9090: where the Debian package installs a system Prometheus service of its own."""
    metrics_export_port: int = 8085
    """Where the Ray node's metrics agent serves Prometheus metrics (Ray's, Serve's, vLLM's, rayline's)."""
    scrape_interval_s: float = 5.0
    gcs_redis: bool = False
    """Keep the GCS's state in an external Redis (Debian's `redis-server`, stack/gcs_store.py), as KubeRay's
    GCS fault tolerance does: a head whose GCS died comes back with the cluster's state, and the worker nodes'
    apps serve on meanwhile."""
    redis_port: int = 6390
    nodes: int = 0
    """Ray worker nodes beside the head: each its own raylet on this machine (`ray start --address`), so the
    stack is a multi-node cluster as Ray's own tests run one. 0 = the head alone."""
    node_cpus: int = 1
    """Logical CPUs of each worker node."""
    node_port_base: int = 21000
    """Worker node i (1..nodes) takes the ports node_port_base + 100 * i + 0..99: its raylet, object
    manager, agents and metrics on the first ten, its workers on the rest."""
    autoscale_nodes: int = 0
    """Run Ray's autoscaler (v2) on the head, free to add up to this many worker nodes of `node_cpus` CPUs
    when work waits for resources and to remove them when idle (stack/ray_autoscaler.py). 0 = off."""
    autoscale_idle_timeout_s: float = 30.0
    """Seconds an autoscaled node stays idle before the autoscaler removes it."""
    production_models: list[str] = field(default_factory=lambda: ["rayline-tiny", "rayline-tiny-arith",
                                                                   "rayline-tiny-base"])
    """Registered models that serve (stack/mlflow_auth.py): created by the admin at `up`, written only by promoters
    and the rollout; each gets `<name>-candidates` beside it for trainers to register into."""
    ray_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every Ray process of the stack (head, worker nodes, autoscaled nodes), e.g. Ray or Serve
    settings read from the environment (`RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S: "2"`); it wins over the stack's own."""
    timeout_s: int = 120

    def __post_init__(self):
        for name in ("ray_port", "dashboard_port", "ray_client_port", "serve_port", "mlflow_port", "s3_port",
                     "memcached_port", "dashboard_agent_port", "min_worker_port", "max_worker_port", "prometheus_port",
                     "metrics_export_port", "redis_port"):
            require(0 < getattr(self, name) < 65536, name, "must be a TCP port (1-65535)")
        require(self.num_cpus >= 0, "num_cpus", "must be >= 0")
        bad = [k for k, v in self.ray_env.items() if not (isinstance(k, str) and k and isinstance(v, str))]
        require(not bad, "ray_env", f"names and values must be strings (quote numbers in YAML): {bad[:3]}")
        require(self.scrape_interval_s > 0, "scrape_interval_s", "must be > 0")
        require(self.min_worker_port < self.max_worker_port, "min_worker_port", "must be below max_worker_port")
        require(self.nodes >= 0, "nodes", f"must be >= 0, got {self.nodes}")
        require(self.node_cpus >= 1, "node_cpus", f"must be >= 1, got {self.node_cpus}")
        require(self.autoscale_nodes >= 0, "autoscale_nodes", f"must be >= 0, got {self.autoscale_nodes}")
        require(self.autoscale_idle_timeout_s > 0, "autoscale_idle_timeout_s",
                f"must be > 0 seconds, got {self.autoscale_idle_timeout_s}")
        require(self.serve_port + 1500 < 65536, "serve_port",
                f"must stay below 64036: Serve's fallback proxy takes serve_port + 500 and + 1500, got {self.serve_port}")
        taken = {getattr(self, n): n for n in ("ray_port", "dashboard_port", "ray_client_port", "mlflow_port", "s3_port",
                                                 "memcached_port", "dashboard_agent_port", "prometheus_port",
                                                 "metrics_export_port", "redis_port")}
        for port in self.serve_fallback_ports:
            require(port not in taken and not self.min_worker_port <= port <= self.max_worker_port, "serve_port",
                    f"Serve's fallback proxy takes serve_port + 500 and + 1500 ({self.serve_fallback_ports}); "
                    f"{port} is {taken.get(port, 'in the worker port range')}: pick another serve_port")
        require(0 < self.node_port_base and self.node_port_base + 100 * (self.nodes + 1) < 65536, "node_port_base",
                f"node_port_base + 100 * (nodes + 1) must stay below 65536, got {self.node_port_base} with {self.nodes} nodes")
        if self.nodes:
            lo, hi = self.node_port_base + 100, self.node_port_base + 100 * (self.nodes + 1) - 1
            require(hi < self.min_worker_port or lo > self.max_worker_port, "node_port_base",
                    f"the worker nodes' ports {lo}-{hi} overlap the head's worker ports "
                    f"{self.min_worker_port}-{self.max_worker_port}")
        for name in ("ray_port", "dashboard_port", "ray_client_port", "dashboard_agent_port", "metrics_export_port"):
            port = getattr(self, name)
            require(not self.min_worker_port <= port <= self.max_worker_port, name,
                    f"{port} falls in the worker port range {self.min_worker_port}-{self.max_worker_port}")
        # Serve's HAProxy mode (core/ray_env.py) gives each ingress replica an HTTP port from 30000-31000 and a
        # gRPC port from 40000-41000 on its node; Ray's worker processes must not take those.
        ranges = [("min_worker_port", self.min_worker_port, self.max_worker_port)]
        if self.nodes:
            ranges.append(("node_port_base", self.node_port_base + 100, self.node_port_base + 100 * (self.nodes + 1) - 1))
        for name, lo, hi in ranges:
            for serve_lo, serve_hi in SERVE_REPLICA_PORTS:
                require(hi < serve_lo or lo > serve_hi, name, f"ports {lo}-{hi} overlap {serve_lo}-{serve_hi}, where "
                        "Serve's direct ingress gives replicas their ports")

    @property
    def state(self) -> Path:
        p = Path(self.state_dir)
        return p if p.is_absolute() else PROJECT_ROOT / p

    @property
    def serve_fallback_ports(self) -> tuple[int, int]:
        """(HTTP, gRPC) ports of Serve's fallback proxy: the Python proxy Ray starts on the head beside HAProxy, to
        which every node's HAProxy sends an app's requests while the app has no running ingress replica it knows of.
        That includes every redeploy that rebuilds the app (a rollout or a canary's promotion pins a new version in
        the app's args): Serve clears the app's ingress deployment while the build task runs, so for those seconds
        HAProxy's only server for the route is this proxy, which still routes to the old replicas. Ray fixes its
        ports (8500, 9500) for every cluster and binds them with SO_REUSEPORT, so on a machine with two stacks the
        kernel handed part of one stack's requests to the other's proxy, which knows none of its routes: 168
        requests of a canary promotion answered 404 over 16 s (issue 51). Each stack takes its own, 500 and 1500
        above its serve_port (the default stack: Ray's own 8500 and 9500)."""
        return self.serve_port + 500, self.serve_port + 1500

    @property
    def ray_temp_dir(self) -> Path:
        """The head's Ray temp dir (its sessions, logs, sockets), one per stack. Ray's job supervisor gives each job's
        driver the GCS address written in `<temp dir>/ray_current_cluster`, which every `ray start` on the machine
        with that temp dir overwrites: with Ray's shared default (/tmp/ray) a job submitted to one of two stacks
        (a developer's `.rayline` and the tests' `.rayline-test`) ran its driver against the stack started last.
        Short, for Ray's unix socket paths; keyed by the GCS port, which no two running stacks share."""
        return Path(tempfile.gettempdir()) / f"rayline-ray-{self.ray_port}"
