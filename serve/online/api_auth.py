"""Who may call the app, and how much: API keys, per-key limits and request caps in front of the OpenAI routes.

`ApiAuth`, an ASGI middleware outermost on the app that serves the routes (the engine replica's own, or the separate
ingress's; serve/llm_hooks.add_rayline_middleware), answers before vLLM, Ray or the canary split sees a request:
  401  no key, or one the keys file does not hold (`Authorization: Bearer <key>`; core/api_keys.py)
  403  a client key asking for what only an admin key may: the canary's force header `x-rayline-canary` (refused, not
       ignored, so a client learns at once that it has no effect), rayline's own routes (`/-/rayline/...`)
  429  over the key's `requests_per_minute` or `max_concurrent` (with `Retry-After`)
  413  a body over `auth.max_body_bytes`
  400  `n` or `best_of` over `auth.max_n`; `max_tokens`, `max_completion_tokens` or `max_output_tokens` over
       `auth.max_tokens`
The errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so the `openai` SDK raises its own
AuthenticationError, PermissionDeniedError, RateLimitError and BadRequestError. Open without a key: the liveness routes
in OPEN_PATHS (Serve answers its own /-/healthz and /-/routes before the app sees a request). There is no switch that
turns keys off.

Limits are kept in each replica (no shared store on the request path), so a key's rate over the whole app is at most
its limit times the replicas serving the routes. A request the canary split forwards carries the client's key, and the
challenger's app (rendered from the same serving config) checks it again.

A key appears nowhere but in the comparison: refusals name the key's id at most, and nothing here logs a request.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from core.api_keys import KEYS_FILE_ENV, ApiKey, hash_key, read_keys_file

log = logging.getLogger("rayline.api_auth")

OPEN_PATHS = frozenset({"/health", "/ping"})
"""Liveness probes (vLLM's): they say nothing about the model and must answer a probe that has no key."""
ADMIN_PREFIX = "/-/rayline/"
"""rayline's own routes (the canary's stats, serve/online/canary_split.py): admin keys only."""
FORCE_HEADER = "x-rayline-canary"  # serve/canary_split.ROUTE_HEADER (that module imports this one)
RECHECK_S = 5.0
"""How often a replica looks whether the keys file changed (a stat; a changed file is read again)."""
N_FIELDS = ("n", "best_of")
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def keys_file_of(keys_file: str) -> str:
    """The keys file a replica reads: the serving config's `auth.keys_file`, else $RAYLINE_API_KEYS_FILE."""
    path = keys_file or os.environ.get(KEYS_FILE_ENV, "")
    if not path:
        raise ValueError(f"no API keys file: set auth.keys_file in the serving config, or {KEYS_FILE_ENV} in the Ray "
                         "processes' environment (the local stack sets it; on Kubernetes mount the Secret "
                         "rayline-openai-keys); every route of the app needs a key")
    return path


class KeyStore:
    """The keys file's entries, read again when the file changes, so a key added or revoked (a rotated Kubernetes
    Secret reaches its mounted file within a minute or so) takes effect without a restart. A file that has become
    unreadable or invalid leaves the last good keys in place, and the replica's log says why once."""

    def __init__(self, path: str | Path, recheck_s: float = RECHECK_S, clock: Callable[[], float] = time.monotonic):
        self.path, self.recheck_s, self.clock = Path(path), recheck_s, clock
        self.keys = read_keys_file(self.path)  # a replica without its keys does not start
        self._stamp, self._checked = self._stat(), clock()
        log.info("API keys: %d from %s (%s)", len(self.keys), self.path, ", ".join(k.id for k in self.keys))

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)  # follows a Secret volume's symlinks: a new inode per update
        return st.st_mtime_ns, st.st_size, st.st_ino

    def refresh(self) -> None:
        now = self.clock()
        if now - self._checked < self.recheck_s:
            return
        self._checked = now
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._stamp = stamp  # a bad file is reported once, not on every recheck
            self.keys = read_keys_file(self.path)
            log.info("API keys: %d from %s, which changed (%s)", len(self.keys), self.path,
                     ", ".join(k.id for k in self.keys))
        except (OSError, ValueError) as e:
            log.error("API keys: keeping the %d keys read before; %s", len(self.keys), e)

    def find(self, key: str) -> ApiKey | None:
        """The entry whose hash is `key`'s, compared in constant time with every entry."""
        self.refresh()
        digest, found = hash_key(key), None
        for entry in self.keys:
            if hmac.compare_digest(entry.sha256, digest):
                found = entry
        return found


@dataclass
class _Usage:
    tokens: float
    at: float
    in_flight: int = 0


class Limits:
    """Per key id: a token bucket that holds `requests_per_minute` requests and refills at that rate (so a burst of a
    minute's worth passes, then one every 60/rpm seconds), and the requests in flight against `max_concurrent`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    def admit(self, key: ApiKey) -> tuple[str, float] | None:
        """None when the request may go (it is then counted until `release`); else why not ("rate" or
        "concurrency") and the seconds after which a retry can pass."""
        now, rpm = self.clock(), key.requests_per_minute
        u = self._usage.setdefault(key.id, _Usage(float(rpm), now))
        u.tokens, u.at = min(float(rpm), u.tokens + (now - u.at) * rpm / 60), now
        if u.in_flight >= key.max_concurrent:
            return "concurrency", 1.0
        if u.tokens < 1:
            return "rate", (1 - u.tokens) * 60 / rpm
        u.tokens -= 1
        u.in_flight += 1
        return None

    def release(self, key: ApiKey) -> None:
        self._usage[key.id].in_flight -= 1


def cap_problem(request: Any, max_n: int, max_tokens: int) -> tuple[str, str] | None:
    """(the field, why) when a JSON request asks for more than the caps allow; None otherwise (a value that is not an
    integer is left to the OpenAI server's own validation)."""
    if not isinstance(request, dict):
        return None
    for names, cap, what in ((N_FIELDS, max_n, "auth.max_n"), (TOKEN_FIELDS, max_tokens, "auth.max_tokens")):
        for name in names:
            value = request.get(name)
            if type(value) is int and value > cap:
                return name, f"'{name}' is {value}, above this server's limit of {cap} ({what})."
    return None


class Gate:
    """What a replica checks requests against: its keys (KeyStore), their limits (Limits) and the serving config's
    caps. Built when the replica starts, so a missing or invalid keys file fails the start, not the first request."""

    def __init__(self, keys_file: str, max_body_bytes: int, max_n: int, max_tokens: int):
        self.keys = KeyStore(keys_file_of(keys_file))
        self.limits = Limits()
        self.max_body_bytes, self.max_n, self.max_tokens = max_body_bytes, max_n, max_tokens

    @classmethod
    def from_config(cls, auth) -> "Gate":
        """From the serving config's `auth` (serve.online.serve_config.AuthConfig)."""
        return cls(auth.keys_file, auth.max_body_bytes, auth.max_n, auth.max_tokens)


class ApiAuth:
    """ASGI middleware: see the module docstring. `on_refused(status)` is told of each refusal (response counts)."""

    def __init__(self, app, gate: Gate, on_refused: Callable[[int], None] | None = None):
        self.app, self.gate, self.on_refused = app, gate, on_refused

    async def __call__(self, scope, receive, send):
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", []) if k.lower() in _READ}
        scheme, _, presented = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        presented = presented.strip() if scheme.lower() == "bearer" else ""
        if not presented:
            return await self._refuse(send, 401, "No API key: send one as `Authorization: Bearer <key>`.",
                                      "invalid_request_error", "missing_api_key", extra=[_BEARER])
        key = self.gate.keys.find(presented)
        if key is None:
            return await self._refuse(send, 401, "Incorrect API key provided.", "invalid_request_error",
                                      "invalid_api_key", extra=[_BEARER])
        if key.role != "admin" and (FORCE_HEADER.encode() in headers or path.startswith(ADMIN_PREFIX)):
            what = f"the header {FORCE_HEADER}" if FORCE_HEADER.encode() in headers else path
            return await self._refuse(send, 403, f"Key {key.id} may not use {what}: an admin key is required.",
                                      "permission_error", "admin_key_required",
                                      FORCE_HEADER if FORCE_HEADER.encode() in headers else None)
        refused = self.gate.limits.admit(key)
        if refused:
            why, retry_s = refused
            limit = (f"{key.requests_per_minute} requests per minute" if why == "rate"
                     else f"{key.max_concurrent} requests at once")
            retry_after = (b"retry-after", str(max(1, round(retry_s))).encode())
            return await self._refuse(send, 429, f"Rate limit of key {key.id} reached: {limit}.", "requests",
                                      f"{why}_limit_exceeded", extra=[retry_after])
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._checked_body(scope, receive, headers, send)
                if receive is None:
                    return
            await self.app(scope, receive, send)
        finally:
            self.gate.limits.release(key)

    async def _checked_body(self, scope, receive, headers, send):
        """The request's `receive` with its body replayed; None once a refusal for the body's size or caps was sent."""
        limit = self.gate.max_body_bytes
        declared = headers.get(b"content-length", b"")
        body = None if declared.isdigit() and int(declared) > limit else await read_body(receive, limit)
        if body is None:
            await self._refuse(send, 413, f"Request body above this server's limit of {limit} bytes "
                                          "(auth.max_body_bytes).", "invalid_request_error", "request_too_large")
            return None
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = None  # the OpenAI server answers malformed JSON itself
        problem = cap_problem(request, self.gate.max_n, self.gate.max_tokens)
        if problem:
            await self._refuse(send, 400, problem[1], "invalid_request_error", "above_limit", problem[0])
            return None
        return replay(body, receive)

    async def _refuse(self, send, status: int, message: str, type_: str, code: str, param: str | None = None,
                      extra: list[tuple[bytes, bytes]] = ()) -> None:
        if self.on_refused is not None:
            self.on_refused(status)
        body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra]})
        await send({"type": "http.response.body", "body": body})


_READ = {b"authorization", b"content-length", FORCE_HEADER.encode()}  # the only request headers the gate looks at
_BEARER = (b"www-authenticate", b"Bearer")


def route_path(scope) -> str:
    """The request's path within the app (Serve mounts the app at its route prefix, given as `root_path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """The request's whole body; None as soon as it grows past `limit` bytes (the rest is left unread)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def replay(body: bytes, receive):
    """The request's body once more, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
