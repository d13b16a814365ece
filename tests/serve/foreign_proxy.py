"""Another stack's Serve proxy on this machine, for the tests of a promotion that must drop no request.

While Serve rebuilds an app (a rollout or a canary's promotion pins a new version in its args), HAProxy's only
server for the app's route is Serve's fallback proxy on the head (stack/config.py `serve_fallback_ports`).
Ray binds that proxy at a fixed port (8500) with SO_REUSEPORT: a second stack on the machine with Ray's ports joins
it, and the kernel hands it part of the first stack's requests, which it answers 404 (issue 51: 168 requests of a
canary promotion over 16 s). `ForeignServeProxy` is that second stack's proxy (a fault injector: it answers every
request 404 as a proxy that knows none of the routes does, and counts them), `haproxy_fallbacks` where the stack's
HAProxy sends an app's requests when it has no ingress replica.
"""

from __future__ import annotations

import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RAY_DEFAULT_FALLBACK_PORT = 8500  # ray.serve._private.constants.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT's default
HAPROXY_DIR = Path("/tmp/haproxy-serve")  # ray.serve._private.constants.RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's folder
_BACKUP = re.compile(r"^\s*server\s+\S+\s+([\d.]+):(\d+)\s+check\s+backup\b", re.M)


class _ReusePortServer(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as Ray's proxy binds: it may join one
        super().server_bind()


class ForeignServeProxy:
    """A Serve proxy of another stack on 127.0.0.1:`port` (Ray's default fallback port), answering 404 to all.

    It binds only where the port is free: where something holds it, that is a real stack's proxy, which the
    stand-in must not take requests from (the test then runs beside the real one). `bound` says which; `hits`
    counts the requests it answered."""

    def __init__(self, port: int = RAY_DEFAULT_FALLBACK_PORT):
        self.port, self.hits, self.bound = port, 0, False
        self._server: ThreadingHTTPServer | None = None

    def __enter__(self) -> "ForeignServeProxy":
        from stack.lifecycle import port_busy

        if port_busy(self.port):
            return self
        owner = self

        class NotFound(BaseHTTPRequestHandler):
            def _answer(self):
                owner.hits += 1
                body = f"Path '{self.path}' not found. Ping http://.../-/routes for available routes.".encode()
                self.send_response(404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self._server = _ReusePortServer(("127.0.0.1", self.port), NotFound)
        self.bound = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def haproxy_fallbacks(stack_cfg) -> set[int]:
    """The ports of the backup servers (Serve's fallback proxy) in the stack head's HAProxy config."""
    from stack.ray_node import NODE_LABEL, alive_nodes
    from stack.parts import ray_token

    heads = [n["node_id"] for n in alive_nodes(stack_cfg.dashboard_port, ray_token(stack_cfg))
             if (n.get("labels") or {}).get(NODE_LABEL) == "head"]
    assert len(heads) == 1, heads
    return {int(port) for _, port in _BACKUP.findall((HAPROXY_DIR / heads[0] / "haproxy.cfg").read_text())}
