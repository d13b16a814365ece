"""The local stack's worker nodes: their ports, labels and `ray start` line, and the launcher that runs it
(`ray start --address ... --block`, kept on loopback).

    python -m stack.ray_node --address=127.0.0.1:6379 [any other `ray start` option ...]
    python -m stack.ray_node --head [...]    # a head whose GCS keeps its state in Redis (gcs_redis)

The stack keeps Ray on 127.0.0.1 with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (stack/lifecycle.py). With that
switch `ray start` refuses to join a cluster ("Multi-node Ray clusters are not supported"), and without it
the CLI rewrites 127.0.0.1 (the head's address and the node's own) to the machine's public IP, where the
loopback-only GCS does not listen and the node's own servers would listen on every interface. This runs
Ray's own CLI with the join allowed and addresses resolved as the switch resolves them; everything else
(`--node-ip-address=127.0.0.1`, ports, labels, the auth token check, `--block`'s watch of the node's
processes) is `ray start`'s. Its workers keep the environment's switch, so they stay on loopback too.
"""

from __future__ import annotations

import json
import sys
import urllib.request

from core.node_labels import NODE_LABEL

NODE_PORTS = ("node_manager", "object_manager", "dashboard_agent_listen", "dashboard_agent_grpc", "runtime_env_agent",
              "metrics_export")


def worker_node_ports(cfg, i: int) -> dict[str, int]:
    """The fixed ports of worker node i (1-based) of a StackConfig; its workers take the rest of its block of 100."""
    base = cfg.node_port_base + 100 * i
    return {name: base + k for k, name in enumerate(NODE_PORTS)}


def worker_node_env(cfg, i: int) -> dict[str, str]:
    """Environment of worker node i's processes: its Serve proxy listens on a port of its own, the first after its
    fixed ones (every node of the stack shares 127.0.0.1, where one port holds one proxy)."""
    return {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(worker_proxy_port(cfg, i))}


def worker_proxy_port(cfg, i: int) -> int:
    """Where worker node i's Serve proxy listens (HTTP), once Serve runs a proxy there."""
    return cfg.node_port_base + 100 * i + len(NODE_PORTS)


WORKER_NODE_RESOURCE = "rayline_worker_node"
"""A custom resource each worker node of the stack has one of (the head none): what pins an elastic training run to
worker nodes, whose size Ray Train counts by resources alone (train/config.py ScalingConfig.node_labels)."""


def worker_node_name(i: int) -> str:
    return f"ray-worker-{i}"


def worker_node_argv(cfg, i: int, python: str) -> list[str]:
    """`ray start` of worker node i through this launcher: joins the head's GCS, with its own ports, CPUs and label."""
    first_worker_port = cfg.node_port_base + 100 * i + 10
    return [
        python, "-m", "stack.ray_node", "--block", f"--address=127.0.0.1:{cfg.ray_port}",
        "--node-ip-address=127.0.0.1", f"--num-cpus={cfg.node_cpus}", "--disable-usage-stats",
        *(f"--{name.replace('_', '-')}-port={port}" for name, port in worker_node_ports(cfg, i).items()),
        f"--min-worker-port={first_worker_port}", f"--max-worker-port={first_worker_port + 89}",
        f"--labels={NODE_LABEL}=worker-{i}", f"--resources={{\"{WORKER_NODE_RESOURCE}\": 1}}",
    ]


def alive_nodes(dashboard_port: int, token: str | None) -> list[dict]:
    """The cluster's alive nodes as the head's dashboard lists them (node_id, labels, resources_total)."""
    url = f"http://127.0.0.1:{dashboard_port}/api/v0/nodes?limit=1000&detail=true"
    try:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            nodes = json.loads(r.read())["data"]["result"]["result"]
    except Exception:
        return []
    return [n for n in nodes if n.get("state") == "ALIVE"]


def main(argv: list[str] | None = None) -> None:
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main as ray_cli

    args = sys.argv[1:] if argv is None else argv
    if "--head" in args:
        # A head started again beside worker nodes that wait for its GCS (GCS fault tolerance, stack/gcs_store.py):
        # their processes carry --gcs-address=<the head's port>, which `ray start` reads as a cluster already running
        # on it. The stack checked the port itself before starting.
        def no_local_gcs() -> frozenset:
            return frozenset()

        no_local_gcs.cache_clear = lambda: None  # ray.shutdown() clears the real one's cache at exit
        services.find_gcs_addresses = no_local_gcs
    else:
        # The join check reads the switch; address resolution gets what the switch gives otherwise (loopback).
        ray_constants.ENABLE_RAY_CLUSTER = True
        services.get_node_ip_address = lambda address=None: "127.0.0.1"  # the stack is IPv4 loopback by design
    sys.argv = ["ray", "start", *args]
    ray_cli()


if __name__ == "__main__":
    main()
