"""The MLflow webhook receiver of `pipelines.rollout --watch`: an alias set in MLflow starts a rollout at once.

MLflow (3.x) POSTs `{"entity": "model_version_alias", "action": "created", "timestamp": ...,
"data": {"name", "alias", "version"}}` with headers X-MLflow-Delivery-Id, X-MLflow-Timestamp and,
when the webhook has a secret, X-MLflow-Signature = "v1," + base64(HMAC-SHA256(secret,
"<delivery id>.<timestamp>.<body>")). Calls for our model and alias wake the watch loop; others are
acknowledged and ignored. The receiver listens on loopback unless configured otherwise.

A delivery starts a rollout, so only MLflow may make one: the receiver does not start without a secret, and
refuses a body over MAX_BODY_BYTES (413, before reading it), a delivery without a valid signature (401), one whose
timestamp is more than MAX_CLOCK_SKEW_S from now (401) and a delivery id it already accepted (409: a replay
within that window; MLflow gives each delivery a new UUID and retries only on 429 and 5xx).

Delivering to a loopback or private address must be allowed on the MLflow server:
MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true in its environment (the local
stack's server has them, stack/lifecycle.py; tests/serve/test_webhook.py has it call a watching rollout).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

EVENT = "model_version_alias.created"
SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER = "X-MLflow-Signature", "X-MLflow-Timestamp", "X-MLflow-Delivery-Id"
MAX_CLOCK_SKEW_S = 300
MAX_BODY_BYTES = 64 * 1024
"""MLflow's alias events are a few hundred bytes."""
_DRAIN_BYTES = 1 << 20  # what a refused body may still send, discarded, so the client reads the answer, not a reset


def sign(secret: str, delivery_id: str, timestamp: str, body: str) -> str:
    """The signature MLflow sends for this delivery (also what tests use to play MLflow)."""
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signature_problem(secret: str, headers, body: str, now: float | None = None) -> str | None:
    """None when the call is authentic; else why it is refused (no secret configured: nothing is authentic)."""
    if not secret:
        return "no webhook secret is configured on the receiver"
    delivery, ts, sig = headers.get(DELIVERY_HEADER), headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER)
    if not (delivery and ts and sig):
        return f"missing {DELIVERY_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}"
    try:
        if abs((now or time.time()) - int(ts)) > MAX_CLOCK_SKEW_S:
            return f"{TIMESTAMP_HEADER} {ts} is more than {MAX_CLOCK_SKEW_S}s away from now (replayed?)"
    except ValueError:
        return f"{TIMESTAMP_HEADER} {ts!r} is not a Unix timestamp"
    if not hmac.compare_digest(sign(secret, delivery, ts, body), sig):
        return "signature does not match the configured secret"
    return None


class DeliveryLog:
    """The delivery ids accepted while their timestamps are within MAX_CLOCK_SKEW_S of now: a signed delivery sent
    again inside that window is a replay (after it, its stale timestamp refuses it). Only signed deliveries are
    logged, so what it holds is bounded by what MLflow sent."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def first(self, delivery_id: str, timestamp: str, now: float | None = None) -> bool:
        """True, and the id remembered, unless it was accepted before."""
        now = time.time() if now is None else now
        with self._lock:
            self._until = {d: t for d, t in self._until.items() if t >= now}
            if delivery_id in self._until:
                return False
            self._until[delivery_id] = int(timestamp) + MAX_CLOCK_SKEW_S
            return True


class WebhookReceiver:
    """HTTP server that calls `on_alias(data, delivery_id)` for `model_version_alias.created` of `model` and `alias`
    (one alias, or several: a canary's watch follows champion and challenger), for signed deliveries only."""

    def __init__(self, model: str, alias: str | tuple[str, ...], on_alias: Callable[[dict, str], None], host: str = "127.0.0.1",
                 port: int = 0, path: str = "/mlflow-webhook", secret: str = ""):
        if not secret:
            raise ValueError("the MLflow webhook receiver needs the secret MLflow signs its deliveries with "
                             "(rollout config webhook_secret_file, or RAYLINE_WEBHOOK_SECRET_FILE); it accepts no "
                             "unsigned delivery")
        self.model, self.on_alias, self.path, self.secret = model, on_alias, path, secret
        self.aliases = (alias,) if isinstance(alias, str) else tuple(alias)
        self.deliveries = DeliveryLog()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{self.path}"

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refuse_unread(self, code: int, error: str) -> None:
                """Answer without reading the body, then discard (up to _DRAIN_BYTES) what the client still sends:
                closing on unread data resets the connection, and the client would see that, not the answer."""
                self._reply(code, {"error": error})
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_WR)
                    self.connection.settimeout(1.0)
                    drained = 0
                    while drained < _DRAIN_BYTES and (chunk := self.connection.recv(65536)):
                        drained += len(chunk)
                except OSError:
                    pass

            def do_POST(self):  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != receiver.path:
                    return self._refuse_unread(404, f"POST {receiver.path} only")
                length = self.headers.get("Content-Length", "")
                if not length.isdigit():
                    return self._refuse_unread(411, "a Content-Length is required")
                if int(length) > MAX_BODY_BYTES:
                    return self._refuse_unread(413, f"body of {length} bytes; at most {MAX_BODY_BYTES}")
                body = self.rfile.read(int(length)).decode("utf-8", "replace")
                self._reply(*receiver.receive(self.headers, body))

            def log_message(self, fmt, *args):  # keep stderr for real problems
                pass

        return Handler

    def receive(self, headers, body: str, now: float | None = None) -> tuple[int, dict]:
        """Status code and reply for one delivery: authenticated, then new, then handled."""
        problem = signature_problem(self.secret, headers, body, now)
        if problem:
            return 401, {"error": problem}
        delivery_id = headers.get(DELIVERY_HEADER)
        if not self.deliveries.first(delivery_id, headers.get(TIMESTAMP_HEADER), now):
            return 409, {"error": f"delivery {delivery_id} was already accepted (a replay)"}
        return self.handle(body, delivery_id)

    def handle(self, body: str, delivery_id: str) -> tuple[int, dict]:
        """Status code and reply for one (authenticated) delivery."""
        try:
            event = json.loads(body)
            data = event.get("data") or {}
            kind = f"{event.get('entity')}.{event.get('action')}"
        except (ValueError, AttributeError):
            return 400, {"error": "body is not a JSON webhook payload"}
        if kind != EVENT:
            return 200, {"accepted": False, "reason": f"event {kind} is not {EVENT}"}
        if data.get("name") != self.model or data.get("alias") not in self.aliases:
            return 200, {"accepted": False, "reason": f"not {self.model}@{'|'.join(self.aliases)}"}
        self.on_alias(data, delivery_id)
        return 200, {"accepted": True}

    def start(self) -> "WebhookReceiver":
        self._thread = threading.Thread(target=self._server.serve_forever, name="rayline-webhook", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def register_webhook(url: str, model: str, secret: str) -> str:
    """Create (or point at `url` again, with `secret`) the MLflow webhook for alias changes; returns its id."""
    from core import registry

    c = registry.client()
    name = f"rayline-rollout-{model}"
    for hook in c.list_webhooks():
        if hook.name == name:
            c.update_webhook(hook.webhook_id, url=url, events=[EVENT], secret=secret, status="ACTIVE")
            return hook.webhook_id
    return c.create_webhook(name=name, url=url, events=[EVENT], secret=secret,
                            description=f"rayline: roll out {model} when an alias is set").webhook_id
