"""The local stack is private by default, checked on a real `stack up`: its secrets are random per state dir, on disk
0600 in 0700 folders, on no process's command line, and the old well-known keys, Prometheus's lifecycle and admin
APIs and a Redis client without the stack's certificate are refused."""

from __future__ import annotations

import dataclasses
import re
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stack import gcs_store, lifecycle as stack, objectstore, processes
from stack.parts import runs_prometheus, webhook_secret_path

OLD_S3_KEYS = ("test:tester", "testing")  # tempauth's sample keys, which the store used before


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def secret_files(state: Path) -> list[Path]:
    """Every file of the state dir that holds a secret: the Ray token, everything in `credentials/` but user names and
    certificates, and the Swift proxy's config (it names the S3 secret key)."""
    found = [state / "ray_auth_token", *(p for p in (state / "credentials").rglob("*") if p.is_file())]
    if (state / "swift" / "proxy-server.conf").exists():
        found.append(state / "swift" / "proxy-server.conf")
    return [p for p in found if p.name != "username" and p.suffix != ".crt"]


def secret_values(state: Path) -> list[str]:
    """What must never show on a command line: each secret file's content (a PEM key's, by its full lines)."""
    values = []
    for path in secret_files(state):
        if path.name == "proxy-server.conf":
            continue  # its secret is credentials/s3/password
        text = path.read_text().strip()
        values += [ln for ln in text.splitlines() if len(ln) == 64] if path.suffix == ".key" else [text]
    return values


def command_lines(pids) -> dict[int, str]:
    """pid -> command line of every process in the sessions of `pids` (a part's processes and whatever they
    started: Ray's GCS, raylet, dashboard, workers)."""
    out = {}
    for pid in {p for sid in pids for p in processes.session_members(sid)}:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass  # gone meanwhile
    return out


def assert_private_and_off_command_lines(cfg: stack.StackConfig) -> None:
    state = cfg.state
    assert mode(state) == 0o700 and mode(state / "credentials") == 0o700
    files = secret_files(state)
    assert webhook_secret_path(cfg) in files and (state / "ray_auth_token") in files
    for path in files:
        assert (mode(path), mode(path.parent)) == (0o600, 0o700), path
    values = secret_values(state)
    assert values and all(len(v) >= 32 for v in values), "a secret shorter than 32 characters"
    lines = command_lines(stack.read_state(state)["pids"].values())
    assert len(lines) > len(stack.read_state(state)["pids"]), lines  # the parts' own children are looked at too
    for pid, line in lines.items():
        leaked = [v[:6] + "..." for v in values if v in line]
        # Ray's raylet names an empty `--ray_redis_password=` for its C++ workers; a value there is a leak.
        leaked += [f for f in re.findall(r"\S*password[=\s]+(?!-)\S+", line, re.IGNORECASE) if not f.endswith("=")]
        assert not leaked, (pid, line[:300], leaked)


def test_secrets_are_private_and_on_no_command_line(local_stack):
    assert_private_and_off_command_lines(local_stack)


def test_s3_takes_the_stacks_keys_only(local_stack):
    if not local_stack.s3:
        pytest.skip(f"S3 tests need Swift: {objectstore.available()}")
    from botocore.exceptions import ClientError

    keys = objectstore.keys(local_stack.state)
    assert keys[0].startswith(f"{objectstore.ACCOUNT}:") and keys != OLD_S3_KEYS
    env = stack.env_vars(local_stack)
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == keys
    buckets = objectstore.client(local_stack.s3_port, *keys).list_buckets()["Buckets"]
    assert local_stack.bucket in [b["Name"] for b in buckets]
    for access, secret in (OLD_S3_KEYS, (keys[0], OLD_S3_KEYS[1])):
        with pytest.raises(ClientError) as refused:
            objectstore.client(local_stack.s3_port, access, secret, timeout=10).list_buckets()
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403, refused.value.response


def test_prometheus_has_no_lifecycle_or_admin_api(local_stack):
    if not runs_prometheus(local_stack):
        pytest.skip("Prometheus is not installed here")
    url = f"http://127.0.0.1:{local_stack.prometheus_port}"

    def post(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, method="POST"), timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert post("/-/reload") == (403, "Lifecycle API is not enabled.")
    assert post("/-/quit") == (403, "Lifecycle API is not enabled.")
    code, body = post("/api/v1/admin/tsdb/snapshot")
    assert code >= 400 and "admin APIs disabled" in body, (code, body)
    assert stack.part_healthy(local_stack, "prometheus")  # still running


# A stack of its own for the GCS's Redis (ports apart from the test stack's and tests/serve/test_gcs_restart.py's).
GCS_PORTS = {"ray_port": 6411, "dashboard_port": 8299, "ray_client_port": 23061, "dashboard_agent_port": 52425,
             "min_worker_port": 23100, "max_worker_port": 23199, "serve_port": 8040, "mlflow_port": 5040,
             "metrics_export_port": 8189, "redis_port": 6394}


@pytest.mark.timeout(300)
def test_the_gcs_redis_takes_only_the_stacks_certificate(stack_cfg, tmp_path):
    """The head's GCS keeps its tables in Redis over TLS with the stack's client certificate; Redis has no
    password, so none goes on Ray's command lines (Ray passes a Redis password to its GCS, raylet and workers
    as an argument), and a client without the certificate gets nothing."""
    reason = gcs_store.available()
    if reason:
        pytest.skip(f"GCS fault tolerance needs Redis: {reason}")
    cfg = dataclasses.replace(stack_cfg, state_dir=str(tmp_path / "state"), s3=False, prometheus=False,
                              gcs_redis=True, **GCS_PORTS)
    try:
        stack.up(cfg, parts=["redis", "ray"])
        namespace = stack.read_state(cfg.state)["gcs_namespace"]
        assert gcs_store.keys(cfg.state, cfg.redis_port, namespace) > 0  # the GCS writes there
        assert_private_and_off_command_lines(cfg)
        with pytest.raises(OSError):  # TLS without a client certificate: the handshake is refused
            gcs_store.command(cfg.state, cfg.redis_port, "PING", identify=False)
        with socket.create_connection(("127.0.0.1", cfg.redis_port), timeout=5) as s:  # plain RESP: no answer
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            try:
                assert b"PONG" not in s.recv(100)
            except ConnectionResetError:
                pass
    finally:
        stack.down(cfg, grace_s=2)
