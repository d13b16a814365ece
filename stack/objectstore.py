"""A real local S3-compatible object store: OpenStack Swift (s3api + tempauth) run from a state dir.

Everything lives under `state_dir/"swift"` (configs, rings, the single device dir `devices/d1`) and
binds only 127.0.0.1. Ports are derived from the proxy port P so several stores can coexist:

    P        swift-proxy-server: S3 API (path-style), Swift API, /healthcheck
    P + 1    swift-object-server
    P + 2    swift-container-server
    P + 3    swift-account-server
    memcached_port (default 11211): memcached, the proxy's token/info cache

`prepare()` only writes files and returns argvs; the caller starts them (in order, foreground, one
PID each, logs on stdout/stderr), stops them with SIGTERM and polls `healthy()`. Servers run with
`workers = 0` (no fork) to stay small on a 2-core box. The S3 keys are made at random once per state dir and
kept in `state_dir/"credentials"/"s3"` (`username`: the access key `<account>:<user>`, `password`: the secret key;
0600 files, as a Kubernetes basic-auth Secret holds them); tempauth's well-known `test:tester` / `testing` are
not configured. The proxy's config names the secret key, so it is 0600 too. `s3_env()` gives the AWS_* variables
for boto3, pyarrow and Ray.
/etc/swift/swift.conf (hash suffix, storage policy) is read from /etc: Swift hard-codes that path.
The proxy also loads a small filter written next to the configs (`rayline_s3compat.py`, see below)
so DeleteObjects from current AWS SDKs works.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.secret_files import private_dir, read_login, write_login, write_secret

SWIFT_BINARIES: tuple[str, ...] = (
    "swift-proxy-server", "swift-object-server", "swift-container-server", "swift-account-server",
    "swift-ring-builder", "memcached",
)
ACCOUNT = "rayline"  # tempauth's access key is "<account>:<user>"; the user is random per state dir
REGION = "us-east-1"
PART_POWER = 8  # 256 partitions: plenty for one device, keeps rings tiny
_BACKENDS = (("object", 1), ("container", 2), ("account", 3))  # (ring/server, offset from proxy port)
_SWIFT_CONF = Path("/etc/swift/swift.conf")
_APT = "apt-get install swift swift-proxy swift-object swift-container swift-account memcached"

_PROXY_PIPELINE = (
    "catch_errors gatekeeper healthcheck proxy-logging cache listing_formats bulk "
    "s3compat s3api tempauth copy slo dlo versioned_writes proxy-logging proxy-server"
)  # versioned_writes is listed because the proxy would otherwise insert it itself, with a warning

# Swift 2.30's s3api insists on Content-MD5 for DeleteObjects (`POST ?delete`) and has no option to
# relax it, while current AWS SDKs (pyarrow's delete_dir, boto3's delete_objects) send an
# x-amz-checksum-* header instead. This paste filter, loaded by the proxy from the swift dir, checks
# whichever of those checksums the stdlib can compute and then supplies the MD5 s3api wants.
_SHIM_MODULE = "rayline_s3compat"
_SHIM_SOURCE = '''"""Written by rayline stack/objectstore.py: Content-MD5 for S3 DeleteObjects."""
import base64, hashlib, io, zlib

CHECKS = {"HTTP_X_AMZ_CHECKSUM_CRC32": lambda b: zlib.crc32(b).to_bytes(4, "big"),
          "HTTP_X_AMZ_CHECKSUM_SHA1": lambda b: hashlib.sha1(b).digest(),
          "HTTP_X_AMZ_CHECKSUM_SHA256": lambda b: hashlib.sha256(b).digest()}
BAD = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>BadDigest</Code>'
       b'<Message>The checksum you specified did not match what we received.</Message></Error>')


def filter_factory(global_conf, **local_conf):
    def make(app):
        def shim(env, start_response):
            query = [q.split("=")[0] for q in env.get("QUERY_STRING", "").split("&")]
            size = int(env.get("CONTENT_LENGTH") or 0)
            if (env["REQUEST_METHOD"] == "POST" and "delete" in query
                    and "HTTP_CONTENT_MD5" not in env and 0 < size <= 10 << 20):
                body = env["wsgi.input"].read(size)
                for key, digest in CHECKS.items():
                    if key in env and base64.b64encode(digest(body)).decode() != env[key]:
                        start_response("400 Bad Request", [("Content-Type", "application/xml")])
                        return [BAD]
                env["wsgi.input"] = io.BytesIO(body)
                env["HTTP_CONTENT_MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
            return app(env, start_response)
        return shim
    return make
'''


def backend_ports(port: int = 8080) -> dict[str, int]:
    """The object/container/account server ports for a proxy on `port` (port+1, +2, +3)."""
    return {name: port + off for name, off in _BACKENDS}


def available() -> str | None:
    """None when Swift and memcached can run here, else a human-readable reason."""
    for binary in SWIFT_BINARIES:
        if shutil.which(binary) is None:
            return f"{binary} not found: {_APT}"
    if not _SWIFT_CONF.is_file():
        # Every Swift server refuses to start without the hash prefix/suffix from this file.
        return f"{_SWIFT_CONF} missing: reinstall the swift package ({_APT})"
    return None


# Servers drop privileges to `user` (default "swift"); we name whoever runs us so the state dir stays
# writable. `workers = 0` serves from the one process we started (no fork), so SIGTERM on it stops all.
def _server_conf(swift_dir: Path, kind: str, port: int) -> str:
    return f"""[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
user = {pwd.getpwuid(os.getuid()).pw_name}
swift_dir = {swift_dir}
devices = {swift_dir / "devices"}
mount_check = false
disable_fallocate = true
log_name = {kind}-server

[pipeline:main]
pipeline = healthcheck {kind}-server

[filter:healthcheck]
use = egg:swift#healthcheck

[app:{kind}-server]
use = egg:swift#{kind}
"""


def login_dir(state: Path) -> Path:
    return Path(state) / "credentials" / "s3"


def keys(state: Path) -> tuple[str, str]:
    """(access key, secret key) of the store under `state`, made at random (0600 files) when absent."""
    folder = login_dir(state)
    if not (folder / "password").exists():
        write_login(folder, f"{ACCOUNT}:{secrets.token_hex(6)}", secrets.token_hex(24))
    return read_login(folder)


def _proxy_conf(swift_dir: Path, port: int, memcached_port: int, access_key: str, secret_key: str) -> str:
    filters = ["catch_errors", "gatekeeper", "healthcheck", "listing_formats", "bulk", "copy",
               "slo", "dlo", "versioned_writes"]
    simple = "".join(f"\n[filter:{name}]\nuse = egg:swift#{name}\n" for name in filters)
    return f"""[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
user = {pwd.getpwuid(os.getuid()).pw_name}
swift_dir = {swift_dir}
log_name = proxy-server

[pipeline:main]
pipeline = {_PROXY_PIPELINE}

[app:proxy-server]
use = egg:swift#proxy
allow_account_management = true
account_autocreate = true

[filter:proxy-logging]
use = egg:swift#proxy_logging

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:{memcached_port}

[filter:tempauth]
use = egg:swift#tempauth
user_{access_key.replace(":", "_")} = {secret_key} .admin

[filter:s3api]
use = egg:swift#s3api
location = {REGION}

[filter:s3compat]
paste.filter_factory = {_SHIM_MODULE}:filter_factory
{simple}"""


def _write(path: Path, text: str, secret: bool = False) -> None:
    # Only touch files whose content changed, so re-running prepare() is cheap and idempotent.
    if path.exists() and path.read_text() == text:
        return
    if secret:
        write_secret(path, text)
    else:
        path.write_text(text)


def _build_ring(swift_dir: Path, kind: str, port: int) -> None:
    ring, builder = swift_dir / f"{kind}.ring.gz", swift_dir / f"{kind}.builder"
    stamp = swift_dir / f"{kind}.ring.port"
    if ring.exists() and stamp.exists() and stamp.read_text() == str(port):
        return  # rings are only rebuilt when the port (hence the device address) changes
    for stale in (ring, builder, stamp):
        stale.unlink(missing_ok=True)
    rb = shutil.which("swift-ring-builder") or "swift-ring-builder"
    for args in (["create", str(PART_POWER), "1", "1"],  # part power, 1 replica, min_part_hours
                 ["add", f"r1z1-127.0.0.1:{port}/d1", "100"]):
        subprocess.run([rb, str(builder), *args], check=True, capture_output=True, text=True)
    # rebalance exits 1 on mere warnings; judge it by the ring file it must write.
    out = subprocess.run([rb, str(builder), "rebalance"], capture_output=True, text=True)
    if not ring.exists():
        raise RuntimeError(f"swift-ring-builder rebalance failed for {kind}: {out.stdout}{out.stderr}")
    stamp.write_text(str(port))


def prepare(state_dir: Path, port: int = 8080, memcached_port: int = 11211) -> list[tuple[str, list[str]]]:
    """Write configs, rings and the device dir under `state_dir/"swift"`; return what to start.

    Idempotent. Returns `(name, argv)` in start order: memcached, swift-object, swift-container,
    swift-account, swift-proxy. Every argv stays in the foreground (one PID, stops on SIGTERM) and
    logs to stderr (`-v`; Swift also tries syslog, which on a box without /dev/log goes to UDP
    localhost:514 and is dropped). Ports: proxy `port`, backends `backend_ports(port)`.
    """
    if reason := available():
        raise RuntimeError(reason)
    swift_dir = private_dir(Path(state_dir).resolve() / "swift")
    (swift_dir / "devices" / "d1").mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, list[str]]] = []
    memcached = [shutil.which("memcached"), "-l", "127.0.0.1", "-p", str(memcached_port),
                 "-U", "0", "-m", "64", "-c", "256"]  # no UDP, 64 MB is ample for tokens
    if os.geteuid() == 0:
        memcached += ["-u", "root"]  # memcached refuses to run as root without naming a user
    procs.append(("memcached", memcached))
    # swift-ring-builder costs ~2 s of interpreter start-up per ring; build the three side by side.
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda kp: _build_ring(swift_dir, *kp), backend_ports(port).items()))
    for kind, bport in backend_ports(port).items():
        conf = swift_dir / f"{kind}-server.conf"
        _write(conf, _server_conf(swift_dir, kind, bport))
        procs.append((f"swift-{kind}", [shutil.which(f"swift-{kind}-server"), str(conf), "-v"]))
    conf = swift_dir / "proxy-server.conf"
    _write(conf, _proxy_conf(swift_dir, port, memcached_port, *keys(state_dir)), secret=True)
    _write(swift_dir / f"{_SHIM_MODULE}.py", _SHIM_SOURCE)
    # `env` execs the server, so the PID is still the proxy's; PYTHONPATH makes the shim importable.
    procs.append(("swift-proxy", [shutil.which("env"), f"PYTHONPATH={swift_dir}",
                                  shutil.which("swift-proxy-server"), str(conf), "-v"]))
    return procs


def s3_env(state: Path, port: int = 8080) -> dict[str, str]:
    """AWS_* variables pointing boto3 / pyarrow / Ray at the store on `port` with the keys of `state`."""
    access_key, secret_key = keys(state)
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": REGION,
        # s3api (Swift 2.30) does not understand the CRC32 checksums newer SDKs send by default.
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }


def client(port: int, access_key: str, secret_key: str, timeout: float = 30.0):
    """A boto3 S3 client for the store on `port` with these keys (path-style, no proxy, no CRC32 checksums)."""
    import boto3  # lazy: keeps this module importable (and available()) without boto3
    from botocore.config import Config

    cfg = Config(
        s3={"addressing_style": "path"},  # no wildcard DNS for bucket.127.0.0.1
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2},
        proxies={},  # loopback: never go through an HTTP(S)_PROXY from the environment
    )
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name=REGION, config=cfg)


def healthy(state: Path, port: int = 8080) -> bool:
    """True when the proxy and all three backends answer /healthcheck and S3 ListBuckets works."""
    if not (login_dir(state) / "password").exists():
        return False  # never prepared: no store of ours runs
    try:
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ignore *_proxy
        for p in (port, *backend_ports(port).values()):
            with direct.open(f"http://127.0.0.1:{p}/healthcheck", timeout=2) as r:
                if r.status != 200:
                    return False
        client(port, *keys(state), timeout=5).list_buckets()  # exercises memcached, tempauth, s3api, account
        return True
    except Exception:
        return False


def ensure_bucket(state: Path, name: str, port: int = 8080) -> None:
    """Create bucket `name` unless it already exists."""
    from botocore.exceptions import ClientError

    s3 = client(port, *keys(state))
    try:
        s3.head_bucket(Bucket=name)
        return
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    try:
        s3.create_bucket(Bucket=name)
    except ClientError as e:  # lost a race with another creator: fine
        if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
