"""The head's GCS killed under serving load, with its state in Redis (issue 21, faults), written once for the test
(tests/serve/test_gcs_restart.py) and the benchmark (bench/bench_faults.py).

On a stack with `gcs_redis` (stack/gcs_store.py) and three 1-CPU worker nodes, the `tiny` app's two engine
replicas run on two of them (the third is room for the rollout's new replicas, which Serve starts before it stops
old ones), and a bounded, paced loopback load goes through those nodes' own Serve proxies (as a KubeRay RayService's
serve Service reaches the worker pods; paced, since the head restarts on the same 2 cores and Ray gives its raylet
30 s to register: it took 21 s behind two saturated engines with the test alone, waiting on the head's dashboard
agent, and a CI run's three starts all failed). The GCS process is SIGKILLed: `ray start
--block` takes the whole head down with it (dashboard, Serve controller, the head's proxy), as the head container
exits on KubeRay. After `outage_s` the head starts again (`stack.up(parts=["ray"])`, as KubeRay restarts the pod)
and its GCS reloads the cluster from Redis. Then a rollout: the champion alias moves to version 2 and
`python -m pipelines.serve` deploys it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tests.serve.serving import deploy, node_ids_by_label, on_worker_nodes, register_fresh, serve_config_dict
from tests.serve.load import ChatLoad, ReplicaTimeline, Request

GCS_APP, GCS_PREFIX, GCS_MODEL = "rayline-test-gcs", "/gcs-test", "rayline-gcs-test"


@dataclass
class GcsRestart:
    streams: int
    pause_s: float  # each stream's pause after an answer
    requests: list[Request]
    killed_at: float  # time.monotonic()
    head_back_at: float  # the new head's dashboard answers
    serve_back_at: float | None  # its Serve controller reports the app's two replicas RUNNING again
    rolled_out_at: float | None  # version 2 answers through the worker proxies
    redis_keys: int  # the GCS's keys in Redis when it was killed
    head_starts: int  # starts the head took to come back (a failed start is retried, as the kubelet does)
    nodes_before: dict[str, str]
    nodes_after: dict[str, str]
    replicas_before: dict[str, str]  # replica id -> node id
    replicas_after: dict[str, str]
    versions: tuple[str, str]
    events: list = field(default_factory=list)

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    def during_outage(self) -> list[Request]:
        """Requests sent while the head was down or its Serve controller not back."""
        back = self.serve_back_at or float("inf")
        return [r for r in self.requests if self.killed_at <= r.start < back]

    def summary(self) -> dict:
        def since_kill(t: float | None):
            return None if t is None else round(t - self.killed_at, 1)

        outage = self.during_outage()
        return {
            "streams": self.streams, "pause_s": self.pause_s, "requests": len(self.requests), "failed": len(self.failed),
            "sent_while_head_down": len(outage), "answered_while_head_down": sum(r.ok for r in outage),
            "head_back_s": since_kill(self.head_back_at), "serve_controller_back_s": since_kill(self.serve_back_at),
            "rollout_done_s": since_kill(self.rolled_out_at), "redis_keys": self.redis_keys,
            "head_starts": self.head_starts,
            "errors": sorted({r.error[:120] for r in self.failed}),
        }


def proxy_urls(cfg, replica_nodes: dict[str, str]) -> list[str]:
    """The Serve proxies of the worker nodes that hold the replicas (replica id -> node id)."""
    from stack.ray_node import worker_proxy_port

    labels = {node: label for label, node in node_ids_by_label(cfg).items()}
    workers = sorted(int(labels[n].removeprefix("worker-")) for n in set(replica_nodes.values()))
    return [f"http://127.0.0.1:{worker_proxy_port(cfg, i)}" for i in workers]


def wait_answered(url: str, timeout_s: float, expect_fingerprint: str | None = None) -> bool:
    """Until the app answers a smoke request at `url` (with that fingerprint when given)."""
    from serve.promotion.verify import smoke_request
    from tests.serve.serving import serving_keys

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            fp = smoke_request(f"{url}{GCS_PREFIX}/v1", "rayline", "ping", timeout_s=10,
                               api_key=serving_keys().client).get("system_fingerprint")
            if expect_fingerprint is None or fp == expect_fingerprint:
                return True
        except Exception:
            pass
        time.sleep(0.5)
    return False


def start_head(cfg, attempts: int = 3) -> int:
    """Start the head again, as KubeRay restarts the head pod: again when a start fails (Ray gives the new raylet 30 s
    to register with a GCS that is still reloading, which a loaded 2-core box can exceed), as the kubelet restarts
    a container that exited. Returns how many starts it took."""
    from stack import lifecycle as stack, parts as stack_parts
    from stack.processes import kill_session_and_wait

    failures = []
    for attempt in range(1, attempts + 1):
        try:
            stack.up(cfg, parts=["ray"])
            return attempt
        except RuntimeError as e:
            failures.append(f"start {attempt}: {e}")
            if attempt == attempts:
                raise RuntimeError("\n".join(failures) +
                                   f"\nlistening there: {listeners(stack_parts.ports(cfg)['ray'])}") from None
            kill_session_and_wait(stack.read_state(cfg.state)["pids"]["ray-head"])  # what the failed start left
            time.sleep(5)  # as the kubelet's back-off; a port the old head held may take a moment to free
    return attempts


def listeners(ports: list[int]) -> dict[int, str]:
    """Which process listens on each of `ports` (for an error message)."""
    import psutil

    found = {}
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
            try:
                found[c.laddr.port] = f"pid {c.pid} {' '.join(psutil.Process(c.pid).cmdline())[:200]}"
            except (psutil.Error, TypeError):
                found[c.laddr.port] = f"pid {c.pid}"
    return found


def serve_gcs_restart(cfg, model_dir, streams: int = 2, pause_s: float = 1.0, warm_s: float = 6.0, outage_s: float = 5.0,
                      after_s: float = 6.0, recover_limit_s: float = 120.0) -> GcsRestart:
    """Run the scenario on the stack `cfg` (gcs_redis on, three 1-CPU worker nodes); the caller's environment must
    point at that stack (stack.env_vars)."""
    from stack import faults as stack_faults, gcs_store, lifecycle as stack
    from core import registry
    from serve.promotion.deploy_target import LocalServe

    if not (cfg.gcs_redis and cfg.nodes >= 3 and cfg.node_cpus == 1):
        raise ValueError(f"needs gcs_redis=true and three 1-CPU worker nodes, got gcs_redis={cfg.gcs_redis} "
                         f"nodes={cfg.nodes} node_cpus={cfg.node_cpus}")
    v1, v2 = register_fresh(GCS_MODEL, [(str(model_dir), {}), (str(model_dir), {})])
    registry.set_alias(GCS_MODEL, "champion", v1)
    serve_cfg = on_worker_nodes(serve_config_dict(GCS_APP, GCS_PREFIX, GCS_MODEL), nodes=3)
    target = LocalServe(GCS_APP)
    try:
        deploy(serve_cfg)
        with ReplicaTimeline(target) as timeline:
            if not timeline.wait_for(lambda t: t.running == 2, 240):
                raise RuntimeError(f"the two replicas did not start: {timeline.events}")
            urls = proxy_urls(cfg, timeline.nodes)
            for url in urls:  # each worker node runs a proxy of its own once it holds a replica
                if not wait_answered(url, 120):
                    up = stack._http_ok(f"{url}/-/healthz")
                    raise RuntimeError(f"no answer through the worker proxy at {url} (its /-/healthz answers: {up})")
            nodes_before, replicas_before = node_ids_by_label(cfg), dict(timeline.nodes)
            namespace = stack.read_state(cfg.state)["gcs_namespace"]
            load = ChatLoad([f"{u}{GCS_PREFIX}/v1" for u in urls], streams, pause_s=pause_s)
            with load:
                time.sleep(warm_s)
                redis_keys = gcs_store.keys(cfg.state, cfg.redis_port, namespace)
                killed_at = time.monotonic()
                stack_faults.kill_gcs(cfg)
                time.sleep(outage_s)
                head_starts = start_head(cfg)
                head_back_at = time.monotonic()
                ids = set(replicas_before)
                back = timeline.wait_for(  # as the new head's controller reports them, not as last seen
                    lambda t: t.polled_at > head_back_at and t.running_ids() == ids and t.running == 2, recover_limit_s)
                serve_back_at = time.monotonic() if back else None
                time.sleep(after_s)
            replicas_after, nodes_after = dict(timeline.nodes), node_ids_by_label(cfg)
            events = list(timeline.events)
        # A rollout after the restart: the alias moves to version 2 and the app is deployed again.
        registry.set_alias(GCS_MODEL, "champion", v2)
        deploy(serve_cfg)
        rolled = all(wait_answered(u, 300, expect_fingerprint=f"{GCS_MODEL}/{v2}") for u in urls)
        rolled_out_at = time.monotonic() if rolled else None
        return GcsRestart(streams, pause_s, sorted(load.requests, key=lambda r: r.start), killed_at, head_back_at,
                          serve_back_at, rolled_out_at, redis_keys, head_starts, nodes_before, nodes_after, replicas_before,
                          replicas_after, (v1, v2), events)
    finally:
        try:
            target.delete()
        except Exception:
            pass
