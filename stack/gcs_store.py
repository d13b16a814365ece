"""The GCS's external store on the local stack: a real Redis (Debian's `redis-server`) on loopback, as KubeRay's
GCS fault tolerance keeps the head's state in Redis (`gcsFaultToleranceOptions`).

With it on (`python -m pipelines.stack up gcs_redis=true`), the head's GCS writes the cluster's tables (nodes,
actors, jobs, placement groups, the internal KV that holds Serve's checkpoints) to Redis. When the GCS dies,
`ray start --block` takes the rest of the head down with it, as the head pod's container exits on KubeRay; the
worker nodes, their Serve proxies and replicas keep running and wait for the GCS
(`gcs_rpc_server_reconnect_timeout_s`, 60 s). A head started again with the same Redis namespace comes back with
that state: the same worker nodes, actors and apps, not a new cluster.

Redis speaks TLS only and admits a client that presents the stack's certificate (`tls-auth-clients yes`); it has
no password. Ray hands a Redis password to the GCS server, the raylets and every worker on their command lines
(`--redis_password=...`, ray/_private/services.py), where any local user reads it in /proc/<pid>/cmdline, while
it takes its Redis TLS settings from the environment (RAY_REDIS_CA_CERT, RAY_REDIS_CLIENT_CERT,
RAY_REDIS_CLIENT_KEY): only the key's path travels, the key stays in a 0600 file. Files: the config and Redis's
working dir in `state_dir/"redis"`, the TLS identity in `state_dir/"credentials"/"redis"` (`tls.crt`, `tls.key`),
made once per state dir. The namespace is made once per head that `down` has not stopped (stack/lifecycle.py), so
a fresh stack never inherits an old cluster's tables.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import socket
import ssl
from pathlib import Path

from core.secret_files import private_dir, write_secret

BINARY = "redis-server"
_APT = "apt-get install redis-server"
HOST = "127.0.0.1"


def available() -> str | None:
    """None when redis-server can run here, else a human-readable reason."""
    return None if shutil.which(BINARY) else f"{BINARY} not found: {_APT}"


def tls_paths(state: Path) -> tuple[Path, Path]:
    """(certificate, private key) of the stack's Redis identity (they may not exist yet)."""
    folder = state / "credentials" / "redis"
    return folder / "tls.crt", folder / "tls.key"


def tls_files(state: Path) -> tuple[Path, Path]:
    """(certificate, private key), made when absent: one self-signed certificate for 127.0.0.1 that is the
    server's, the client's and the one both trust. Server and client (the head's GCS) are the same user's
    processes on loopback; what a connection proves is that it holds the 0600 key."""
    cert, key = tls_paths(state)
    if cert.exists() and key.exists():
        return cert, key
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rayline-gcs-redis")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(private, hashes.SHA256())
    )
    write_secret(key, private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()).decode())
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))  # public: no secret in it
    return cert, key


def prepare(state: Path, port: int) -> list[str]:
    """Write the config (loopback, TLS only, clients must show the stack's certificate, no snapshots: the GCS's
    state lives as long as this Redis runs, as in a KubeRay Redis without persistence); return redis-server's
    argv."""
    home = private_dir(state / "redis")
    cert, key = tls_files(state)
    conf = home / "redis.conf"
    conf.write_text("\n".join([
        f"bind {HOST}", "port 0", f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
        f"tls-ca-cert-file {cert}", "tls-auth-clients yes", "protected-mode yes",
        f"dir {home}", 'save ""', "appendonly no", "daemonize no", "loglevel notice", "logfile \"\"", "",
    ]))
    return [shutil.which(BINARY) or BINARY, str(conf)]


def head_env(state: Path, port: int, namespace: str) -> dict[str, str]:
    """Environment of `ray start --head` that keeps the GCS's state in this Redis under `namespace` (KubeRay sets
    RAY_REDIS_ADDRESS and RAY_external_storage_namespace the same way), over TLS with the stack's certificate."""
    cert, key = tls_files(state)
    return {"RAY_REDIS_ADDRESS": f"rediss://{HOST}:{port}", "RAY_external_storage_namespace": namespace,
            "RAY_REDIS_CA_CERT": str(cert), "RAY_REDIS_CLIENT_CERT": str(cert), "RAY_REDIS_CLIENT_KEY": str(key)}


def new_namespace() -> str:
    return f"rayline-{secrets.token_hex(6)}"


def client_context(state: Path, identify: bool = True) -> ssl.SSLContext:
    """TLS settings of a client of the stack's Redis: trusts its certificate, and (with `identify`) shows it."""
    cert, key = tls_paths(state)
    ctx = ssl.create_default_context(cafile=str(cert))
    if identify:
        ctx.load_cert_chain(cert, key)
    return ctx


def command(state: Path, port: int, *args: str, timeout: float = 2.0, identify: bool = True) -> bytes:
    """One Redis command over TLS; the first line of its reply (what PING and an integer reply need)."""
    request = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection((HOST, port), timeout=timeout) as raw, \
            client_context(state, identify).wrap_socket(raw, server_hostname=HOST) as s:
        s.sendall(request)
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis on {HOST}:{port} closed the connection")
            reply += chunk
    return reply.split(b"\r\n", 1)[0]


def healthy(state: Path, port: int) -> bool:
    if not all(p.exists() for p in tls_paths(state)):
        return False  # never prepared: nothing of ours can be running
    try:
        return command(state, port, "PING") == b"+PONG"
    except OSError:  # ssl.SSLError included
        return False


def keys(state: Path, port: int, namespace: str) -> int:
    """How many keys the GCS keeps in Redis under `namespace` (0 when none: no state to come back with)."""
    reply = command(state, port, "EVAL", "return #redis.call('KEYS', ARGV[1])", "0", f"*{namespace}*")
    return int(reply.lstrip(b":"))
