"""The MLflow webhook receiver of `pipelines.rollout --watch`: an alias set in MLflow starts a rollout at once.

MLflow (3.x) POSTs `{"entity": "model_version_alias", "action": "created", "timestamp": ...,
"data": {"name", "alias", "version"}}` with headers X-MLflow-Delivery-Id, X-MLflow-Timestamp and,
when the webhook has a secret, X-MLflow-Signature = "v1," + base64(HMAC-SHA256(secret,
"<delivery id>.<timestamp>.<body>")). Calls for our model and alias wake the watch loop; others are
acknowledged and ignored. The receiver listens on loopback unless configured otherwise.

Delivering to a loopback or private address must be allowed on the MLflow server:
MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true in its environment (the local
stack's server has them, pipelines/stack.py; tests/serve/test_webhook.py has it call a watching rollout).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

EVENT = "model_version_alias.created"
SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER = "X-MLflow-Signature", "X-MLflow-Timestamp", "X-MLflow-Delivery-Id"
MAX_CLOCK_SKEW_S = 300


def sign(secret: str, delivery_id: str, timestamp: str, body: str) -> str:
    """The signature MLflow sends for this delivery (also what tests use to play MLflow)."""
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signature_problem(secret: str | None, headers, body: str, now: float | None = None) -> str | None:
    """None when the call is authentic (or no secret is configured); else why it is refused."""
    if not secret:
        return None
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


class WebhookReceiver:
    """HTTP server that calls `on_alias(data, delivery_id)` for `model_version_alias.created` of `model` and `alias`
    (one alias, or several: a canary's watch follows champion and challenger)."""

    def __init__(self, model: str, alias: str | tuple[str, ...], on_alias: Callable[[dict, str], None], host: str = "127.0.0.1",
                 port: int = 0, path: str = "/mlflow-webhook", secret: str | None = None):
        self.model, self.on_alias, self.path, self.secret = model, on_alias, path, secret
        self.aliases = (alias,) if isinstance(alias, str) else tuple(alias)
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

            def do_POST(self):  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != receiver.path:
                    return self._reply(404, {"error": f"POST {receiver.path} only"})
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode("utf-8", "replace")
                problem = signature_problem(receiver.secret, self.headers, body)
                if problem:
                    return self._reply(401, {"error": problem})
                code, payload = receiver.handle(body, self.headers.get(DELIVERY_HEADER, ""))
                self._reply(code, payload)

            def log_message(self, fmt, *args):  # keep stderr for real problems
                pass

        return Handler

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


def register_webhook(url: str, model: str, secret: str | None = None) -> str:
    """Create (or point at `url` again) the MLflow webhook for alias changes; returns its id."""
    from pipelines import registry

    c = registry.client()
    name = f"rayline-rollout-{model}"
    for hook in c.list_webhooks():
        if hook.name == name:
            c.update_webhook(hook.webhook_id, url=url, events=[EVENT], secret=secret, status="ACTIVE")
            return hook.webhook_id
    return c.create_webhook(name=name, url=url, events=[EVENT], secret=secret,
                            description=f"rayline: roll out {model} when an alias is set").webhook_id
