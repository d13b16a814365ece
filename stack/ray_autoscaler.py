"""Ray's own autoscaler on the local stack: `python -m pipelines.stack up autoscale_nodes=N`.

The head runs Ray's autoscaler (v2, `--autoscaling-config`) with the fake multi-node provider that Ray's
autoscaler tests use: when a task, actor, placement group or Serve replica waits for resources the head
lacks, the autoscaler launches a worker node, a raylet on this machine with `node_cpus` CPUs and the label
`rayline.io/node=autoscaled`, and removes a node idle for `autoscale_idle_timeout_s`. It is Ray's real
scheduler-to-autoscaler loop (pending demand -> launch -> node joins -> idle -> terminate); only the
"machine" is a process. On Kubernetes the same decisions launch pods (KubeRay's in-tree autoscaler, which
pipelines.render turns on).

The provider starts its nodes from the autoscaler's process on the head, which inherits the stack's loopback
switch: the nodes' servers listen on 127.0.0.1 only. Ray's `AutoscalingCluster` helper is not used: it runs
`ray stop --force` (every Ray on the machine) and names the provider by its type, for which the autoscaler
reads defaults from a file the Ray wheel does not ship (the monitor exits); the config here names the same
provider class as an external module.
"""

from __future__ import annotations

import json
import os

from core.node_labels import NODE_LABEL

FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
"""The head's node id the provider expects (ray.autoscaler._private.fake_multi_node.node_provider)."""
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
HEAD_TYPE, WORKER_TYPE = "ray.head.default", "rayline.worker"
AUTOSCALED_LABEL = "autoscaled"

AUTOSCALER_ENV = {
    "RAY_FAKE_CLUSTER": "1",
    "RAY_enable_autoscaler_v2": "1",
    "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
}
"""The head's environment for the fake provider and autoscaler v2 (as ray.cluster_utils.AutoscalingCluster)."""
AUTOSCALED_NODE_ENV = {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": "0"}
"""What the head passes on to the nodes the provider starts (they inherit the autoscaler's environment): a Serve
proxy on an autoscaled node binds a free port, not the head proxy's, which every node on 127.0.0.1 shares (the
head's own proxy ignores this setting)."""


def autoscaling_config(head_cpus: int, node_cpus: int, max_nodes: int, idle_timeout_s: float, gcs_address: str) -> dict:
    """Ray's cluster config for the autoscaler: the head's resources, one worker type of 0..max_nodes nodes."""
    return {
        "cluster_name": "rayline-local",
        "max_workers": max_nodes,
        "provider": {
            # Ray's fake multi-node provider, named as an external module: under its own type name the autoscaler
            # reads defaults from an example.yaml that the Ray wheel does not ship, and exits.
            "type": "external", "module": FAKE_PROVIDER, "use_node_id_as_ip": True, "disable_node_updaters": True,
            "disable_launch_config_check": True, "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": node_cpus}, "labels": {NODE_LABEL: AUTOSCALED_LABEL}, "node_config": {},
                "min_workers": 0, "max_workers": max_nodes,
            },
        },
        "head_node_type": HEAD_TYPE,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "upscaling_speed": 1.0,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def head_autoscaler(cfg) -> tuple[list[str], dict[str, str]]:
    """The head's extra `ray start` options and environment for a StackConfig with `autoscale_nodes` (none
    without); writes the cluster config to the state dir."""
    if not cfg.autoscale_nodes:
        return [], {}
    path = cfg.state / "ray-autoscaling.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = autoscaling_config(
        head_cpus=cfg.num_cpus or os.cpu_count(), node_cpus=cfg.node_cpus, max_nodes=cfg.autoscale_nodes,
        idle_timeout_s=cfg.autoscale_idle_timeout_s, gcs_address=f"127.0.0.1:{cfg.ray_port}",
    )
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML: `--autoscaling-config` reads it
    return [f"--autoscaling-config={path}"], {**AUTOSCALER_ENV, **AUTOSCALED_NODE_ENV}
