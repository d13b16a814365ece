"""`ray start --address ... --block` for a worker node of the local stack, kept on loopback.

    python -m pipelines.ray_node --address=127.0.0.1:6379 [any other `ray start` option ...]

The stack keeps Ray on 127.0.0.1 with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (pipelines/stack.py). With that
switch `ray start` refuses to join a cluster ("Multi-node Ray clusters are not supported"), and without it
the CLI rewrites 127.0.0.1 (the head's address and the node's own) to the machine's public IP, where the
loopback-only GCS does not listen and the node's own servers would listen on every interface. This runs
Ray's own CLI with the join allowed and addresses resolved as the switch resolves them; everything else
(`--node-ip-address=127.0.0.1`, ports, labels, the auth token check, `--block`'s watch of the node's
processes) is `ray start`'s. Its workers keep the environment's switch, so they stay on loopback too.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from ray._common.network_utils import get_localhost_ip
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main as ray_cli

    # The join check reads the switch; address resolution gets what the switch gives otherwise (loopback).
    ray_constants.ENABLE_RAY_CLUSTER = True
    services.get_node_ip_address = lambda address=None: get_localhost_ip()
    sys.argv = ["ray", "start", *(sys.argv[1:] if argv is None else argv)]
    ray_cli()


if __name__ == "__main__":
    main()
