"""The GCS's external store on the local stack: a real Redis (Debian's `redis-server`) on loopback, as KubeRay's
GCS fault tolerance keeps the head's state in Redis (`gcsFaultToleranceOptions`).

With it on (`python -m pipelines.stack up gcs_redis=true`), the head's GCS writes the cluster's tables (nodes,
actors, jobs, placement groups, the internal KV that holds Serve's checkpoints) to Redis. When the GCS dies,
`ray start --block` takes the rest of the head down with it, as the head pod's container exits on KubeRay; the
worker nodes, their Serve proxies and replicas keep running and wait for the GCS
(`gcs_rpc_server_reconnect_timeout_s`, 60 s). A head started again with the same Redis namespace comes back with
that state: the same worker nodes, actors and apps, not a new cluster.

Everything lives under `state_dir/"redis"`: the config (0600: it holds the password, as a Secret holds it on
Kubernetes) and Redis's working dir. The password is made once per state dir; the namespace once per head
that `down` has not stopped (pipelines/stack.py), so a fresh stack never inherits an old cluster's tables.
"""

from __future__ import annotations

import secrets
import shutil
import socket
from pathlib import Path

BINARY = "redis-server"
_APT = "apt-get install redis-server"


def available() -> str | None:
    """None when redis-server can run here, else a human-readable reason."""
    return None if shutil.which(BINARY) else f"{BINARY} not found: {_APT}"


def password(state: Path) -> str:
    path = state / "redis_password"
    if not path.exists():
        path.write_text(secrets.token_hex(24))
        path.chmod(0o600)
    return path.read_text().strip()


def prepare(state: Path, port: int) -> list[str]:
    """Write the config (loopback only, the password, no snapshots: the GCS's state lives as long as this Redis
    runs, as in a KubeRay Redis without persistence) and return redis-server's argv."""
    home = state / "redis"
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "redis.conf"
    conf.write_text("\n".join([
        "bind 127.0.0.1", f"port {port}", "protected-mode yes", f"requirepass {password(state)}",
        f"dir {home}", 'save ""', "appendonly no", "daemonize no", "loglevel notice", "logfile \"\"", "",
    ]))
    conf.chmod(0o600)
    return [shutil.which(BINARY) or BINARY, str(conf)]


def head_options(state: Path, port: int, namespace: str) -> tuple[list[str], dict[str, str]]:
    """`ray start --head` options and environment that keep the GCS's state in this Redis under `namespace`
    (KubeRay sets the same: RAY_REDIS_ADDRESS, RAY_external_storage_namespace, --redis-password)."""
    return ([f"--redis-password={password(state)}"],
            {"RAY_REDIS_ADDRESS": f"127.0.0.1:{port}", "RAY_external_storage_namespace": namespace})


def new_namespace() -> str:
    return f"rayline-{secrets.token_hex(6)}"


def command(port: int, pw: str, *args: str, timeout: float = 2.0) -> bytes:
    """One Redis command over RESP after AUTH; the raw reply of the command."""
    def encode(*parts: str) -> bytes:
        return f"*{len(parts)}\r\n".encode() + b"".join(f"${len(p.encode())}\r\n{p}\r\n".encode() for p in parts)

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(encode("AUTH", pw) + encode(*args))
        reply = b""
        while reply.count(b"\r\n") < 2:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    first, _, rest = reply.partition(b"\r\n")
    if first != b"+OK":
        raise RuntimeError(f"redis on 127.0.0.1:{port}: AUTH failed: {first.decode(errors='replace')}")
    return rest


def healthy(state: Path, port: int) -> bool:
    try:
        return command(port, password(state), "PING").startswith(b"+PONG")
    except (OSError, RuntimeError):
        return False


def keys(state: Path, port: int, namespace: str) -> int:
    """How many keys the GCS keeps in Redis under `namespace` (0 when none: no state to come back with)."""
    reply = command(port, password(state), "EVAL", "return #redis.call('KEYS', ARGV[1])", "0", f"*{namespace}*")
    return int(reply.split(b"\r\n", 1)[0].lstrip(b":"))
