#!/usr/bin/env python3
"""The local stack's HAProxy: Ray Serve's HAProxy ingress (core/ray_env.py) with every listener on 127.0.0.1.

Ray 2.60's HAProxy config binds, besides the Serve frontend (on `http_options.host`, 127.0.0.1 here), a stats page
(`bind *:8404`) and a Prometheus exporter (`bind :9101`) on every interface at fixed ports: every node of a
stack, and every stack, on one machine would take the same two ports, and the servers would not be loopback-only.
The stack points Ray at this file (`RAY_SERVE_HAPROXY_BINARY_PATH`). It writes the config Ray passes with `-f`
to a sibling `<file>.loopback` and execs the real binary (`RAYLINE_HAPROXY_BINARY`) on it in its own place (the
same pid, every other argument as given), with:
- the stats page and the exporter left out (Ray's manager reads HAProxy over its admin socket, not these);
- any other bind on every interface moved to 127.0.0.1;
- a bind on port 0 (an autoscaled node's proxy: `RAY_SERVE_WORKER_PROXY_HTTP_PORT=0`, a port of its own; HAProxy
  refuses 0) given a free port, kept in `<file>.port` for the later reloads by the same Serve HAProxy manager (this
  process's parent). The file outlives the cluster (`/tmp/haproxy-serve/<node id>/`) and the fake provider's node ids
  repeat from cluster to cluster, so a port kept for another manager is never reused: one kept since the day before
  had been taken by another socket, and the new node's HAProxy failed to bind it at every start (a test run,
  2026-12-05).
Only the standard library: it runs at every HAProxy start and reload.
"""

from __future__ import annotations

import os
import re
import socket
import sys

LEFT_OUT = ("frontend prometheus", "listen stats")
BIND = re.compile(r"^(\s*bind\s+)(\S*):(\d+)(.*)$")
EVERY_INTERFACE = ("", "*", "0.0.0.0", "::", "[::]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_config(text: str, port_for_zero) -> str:
    """The config with the left-out sections dropped and every bind on 127.0.0.1 (port 0 -> port_for_zero())."""
    out, skipping = [], False
    for line in text.splitlines():
        if line and not line[0].isspace():  # a section header starts at column 0
            skipping = line.strip() in LEFT_OUT
        if skipping:
            continue
        m = BIND.match(line)
        if m:
            host = "127.0.0.1" if m.group(2) in EVERY_INTERFACE else m.group(2)
            port = m.group(3) if m.group(3) != "0" else str(port_for_zero())
            line = f"{m.group(1)}{host}:{port}{m.group(4)}"
        out.append(line)
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    real = os.environ.get("RAYLINE_HAPROXY_BINARY")
    if not real:
        sys.exit("haproxy_loopback: RAYLINE_HAPROXY_BINARY (the real haproxy binary) is not set")
    args = list(argv)
    if "-f" in args[:-1]:
        i = args.index("-f") + 1
        src = args[i]

        def kept_port() -> int:
            port_file, owner = f"{src}.port", str(os.getppid())
            try:
                kept_by, port = open(port_file).read().split()
                if kept_by == owner:
                    return int(port)
            except (OSError, ValueError):  # none kept yet, or in an older form
                pass
            port = free_port()
            with open(port_file, "w") as f:
                f.write(f"{owner} {port}")
            return port

        with open(src) as f:
            text = loopback_config(f.read(), kept_port)
        dst = f"{src}.loopback"
        with open(f"{dst}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{dst}.tmp", dst)
        args[i] = dst
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
