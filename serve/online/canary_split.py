"""The champion replica's side of a canary: which requests the challenger answers, and what each side's answers cost.

A canary rollout (serve/promotion/canary.py) deploys the challenger as an app of its own beside the champion's and then sets
`canary` in the `user_config` of the champion deployment that serves the routes, the engine replicas or (`ingress:
deployment`) the OpenAI ingress replicas (Serve hands it to the running replicas, no restart):

    {"share": 0.25, "mode": "split" | "shadow", "url": "http://127.0.0.1:8000/app-challenger", "sticky_header": ""}

`CanarySplit`, an ASGI middleware in front of the OpenAI routes on every such champion replica, then:
  split   sends `share` of the completion requests to the challenger (HTTP, streamed through as it comes) and answers
          the rest itself. A request's `sticky_header` (when configured and sent), else its `user`, else its chat's
          opening (leading system messages and the first user message, which every later turn repeats) picks its
          side by a hash, so a conversation stays on one version at a given share, and moves only one way as the
          share grows; completions without `user` are drawn at random. A challenger that cannot be reached, or
          answers 5xx before its first byte (or 404: its app is gone), is counted against it and the request is
          answered by the champion: clients never see it fail.
  shadow  answers every request itself and sends a copy of `share` of them to the challenger, whose answer is
          read, measured and dropped: clients never get a challenger answer.
The header `x-rayline-canary: champion|challenger` forces a side (the rollout's quality probe); such requests are
not counted as live traffic. Only an admin key may send it, and only an admin key may read the stats route: the API
key middleware in front of this one (serve/online/api_auth.py) refuses both to a client key with 403. Every response says which side answered (`x-rayline-canary`).

Per side the middleware keeps, for the rollout's step analysis, each live request's outcome, time to first byte
(TTFT) and mean gap between streamed chunks (inter-token latency), served at `GET /-/rayline/canary?since=T` (this
replica's alone), and exports them as `rayline_canary_requests` / `_ttft_seconds` / `_itl_seconds`, which a rollout
reads from Prometheus over every replica (serve/promotion/canary_metrics.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from core import metrics
from serve.online.api_auth import FORCE_HEADER, read_body, replay, route_path

CHAMPION, CHALLENGER = "champion", "challenger"
ROUTE_HEADER = FORCE_HEADER  # honoured for admin keys only: serve/online/api_auth.py refuses it from a client key (403)
STATS_PATH = "/-/rayline/canary"
SPLIT_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_EVENTS = 100_000
MAX_SHADOWS_IN_FLIGHT = 8
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


@dataclass
class Event:
    t: float
    role: str
    ok: bool
    ttft_s: float | None
    itl_s: float | None
    shadow: bool = False


def side_of(key: str | None, share: float) -> str:
    """The side a request with this sticky key goes to at `share` (a key's point in [0, 1) is fixed, so raising the
    share only ever moves keys from champion to challenger); without a key, a random draw."""
    if share <= 0:
        return CHAMPION
    point = (int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32) if key else random.random()
    return CHALLENGER if point < share else CHAMPION


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(events: list[Event]) -> dict[str, dict[str, Any]]:
    """Per side: requests, errors, error ratio, TTFT p50/p99 and mean inter-token latency of its live requests."""
    out = {}
    for role in (CHAMPION, CHALLENGER):
        mine = [e for e in events if e.role == role]
        ttft = [e.ttft_s for e in mine if e.ok and e.ttft_s is not None]
        itl = [e.itl_s for e in mine if e.ok and e.itl_s is not None]
        errors = sum(not e.ok for e in mine)
        out[role] = {"requests": len(mine), "errors": errors, "error_ratio": errors / len(mine) if mine else 0.0,
                     "shadow": sum(e.shadow for e in mine), "ttft_p50_s": quantile(ttft, 0.5),
                     "ttft_p99_s": quantile(ttft, 0.99), "itl_mean_s": sum(itl) / len(itl) if itl else None}
    return out


class CanaryState:
    """The replica's canary settings (from `user_config`) and its record of live requests."""

    def __init__(self, tags: dict[str, str] | None = None):
        self.config: dict[str, Any] = {}
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self.tags = dict(tags or {})
        self._client = None
        self.shadows_in_flight = 0

    def configure(self, config: dict[str, Any] | None) -> None:
        config = dict(config or {})
        if config:
            share = float(config.get("share", 0))
            if not 0 <= share <= 1:
                raise ValueError(f"canary.share: must be within [0, 1], got {share}")
            if config.get("mode", "split") not in ("split", "shadow"):
                raise ValueError(f"canary.mode: must be split or shadow, got {config.get('mode')!r}")
            if not str(config.get("url", "")).startswith(("http://", "https://")):
                raise ValueError(f"canary.url: must be the challenger app's http(s) URL, got {config.get('url')!r}")
        self.config = config

    @property
    def active(self) -> bool:
        return bool(self.config)

    def client(self):
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
        return self._client

    def record(self, role: str, ok: bool, ttft_s: float | None, itl_s: float | None, shadow: bool = False) -> None:
        self.events.append(Event(time.time(), role, ok, ttft_s, itl_s, shadow))
        metrics.inc("rayline_canary_requests", 1, role=role, outcome="ok" if ok else "error",
                    mode="shadow" if shadow else "live", **self.tags)
        if ok and ttft_s is not None:
            metrics.observe("rayline_canary_ttft_seconds", ttft_s, role=role, **self.tags)
        if ok and itl_s is not None:
            metrics.observe("rayline_canary_itl_seconds", itl_s, role=role, **self.tags)

    def report(self, since: float) -> dict[str, Any]:
        return {"config": self.config, "now": time.time(),
                "sides": summarize([e for e in self.events if e.t >= since])}


class Timing:
    """Wraps an ASGI `send`: the response status, time to the first body byte and the gaps between body chunks."""

    def __init__(self, send, start: float, role: str):
        self._send, self.start, self.role = send, start, role
        self.status = 0
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = {**message, "headers": [*message.get("headers", []), (ROUTE_HEADER.encode(), self.role.encode())]}
        elif message["type"] == "http.response.body" and message.get("body"):
            now = time.monotonic()
            self.first = self.first or now
            self.last, self.chunks = now, self.chunks + 1
        if self._send is not None:
            await self._send(message)

    def outcome(self) -> tuple[bool, float | None, float | None]:
        ok = 0 < self.status < 500
        ttft = self.first - self.start if self.first is not None else None
        itl = (self.last - self.first) / (self.chunks - 1) if self.chunks > 1 else None
        return ok, ttft, itl


class CanarySplit:
    """ASGI middleware of a champion replica: see the module docstring."""

    def __init__(self, app, state: CanaryState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path == STATS_PATH and scope["method"] == "GET":
            return await self._stats(scope, send)
        if not (self.state.active and scope["method"] == "POST" and path in SPLIT_PATHS):
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        forced = headers.get(ROUTE_HEADER)
        cfg = self.state.config
        live = forced not in (CHAMPION, CHALLENGER)
        if not live:
            role = forced
        elif cfg.get("mode") == "shadow":
            role = CHAMPION
            if random.random() < float(cfg.get("share", 0)) and self.state.shadows_in_flight < MAX_SHADOWS_IN_FLIGHT:
                self.state.shadows_in_flight += 1  # counted here: a burst must not start more than the limit
                asyncio.get_running_loop().create_task(self._shadow(path, body, headers))
        else:
            share = float(cfg.get("share", 0))
            role = side_of(_sticky_key(body, headers, cfg.get("sticky_header", "")), share) if share > 0 else CHAMPION
        if role == CHALLENGER and await self._forward(path, body, headers, send, live):
            return
        timing = Timing(send, time.monotonic(), CHAMPION)
        try:
            await self.app(scope, replay(body, receive), timing)
        finally:
            if live:
                self.state.record(CHAMPION, *timing.outcome())

    def _to_challenger(self, path: str, body: bytes, headers: dict[str, str]):
        """The request as the challenger's route gets it (streamed response; hop-by-hop headers dropped)."""
        out = {k: v for k, v in headers.items() if k not in _HOP and k != ROUTE_HEADER}
        return self.state.client().stream("POST", self.state.config["url"].rstrip("/") + path, content=body,
                                          headers=out)

    async def _forward(self, path: str, body: bytes, headers: dict[str, str], send, live: bool) -> bool:
        """Answer from the challenger; False (nothing sent yet) when it could not: the champion answers instead."""
        timing = Timing(send, time.monotonic(), CHALLENGER)
        try:
            async with self._to_challenger(path, body, headers) as r:
                if r.status_code >= 500 or r.status_code == 404:  # 404: its route is gone (the app removed)
                    await r.aread()
                    if live:
                        self.state.record(CHALLENGER, False, None, None)
                    return False
                await timing({"type": "http.response.start", "status": r.status_code,
                              "headers": [(k.encode(), v.encode()) for k, v in r.headers.items() if k not in _HOP]})
                async for chunk in r.aiter_raw():
                    await timing({"type": "http.response.body", "body": chunk, "more_body": True})
                await timing({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:
            if timing.status:  # the client already has part of the answer: the stream ends cut short
                if live:
                    self.state.record(CHALLENGER, False, None, None)
                raise
            if live:
                self.state.record(CHALLENGER, False, None, None)
            return False
        if live:
            self.state.record(CHALLENGER, *timing.outcome())
        return True

    async def _shadow(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        """A copy of a live request for the challenger: answered, measured, dropped."""
        timing = Timing(None, time.monotonic(), CHALLENGER)
        try:
            async with self._to_challenger(path, body, headers) as r:
                await timing({"type": "http.response.start", "status": r.status_code, "headers": []})
                async for chunk in r.aiter_raw():
                    await timing({"type": "http.response.body", "body": chunk})
            self.state.record(CHALLENGER, *timing.outcome(), shadow=True)
        except Exception:
            self.state.record(CHALLENGER, False, None, None, shadow=True)
        finally:
            self.state.shadows_in_flight -= 1

    async def _stats(self, scope, send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        try:
            since = float(query.get("since", ["0"])[0])
        except ValueError:
            since = 0.0
        payload = json.dumps(self.state.report(since)).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def _sticky_key(body: bytes, headers: dict[str, str], sticky_header: str) -> str | None:
    """What keeps a request's side: the `sticky_header` value when configured and sent, else the body's `user`, else
    its conversation (a chat's opening: its leading system messages and its first user message, which every later
    turn of the same chat repeats). None (a random draw) for a completion without `user`, or a body that is not JSON."""
    if sticky_header and (value := headers.get(sticky_header.lower())):
        return value
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if request.get("user"):
        return str(request["user"])
    return conversation_key(request.get("messages"))


def conversation_key(messages) -> str | None:
    """A chat's identity without a `user`: its messages up to and including the first user message, hashed."""
    if not isinstance(messages, list):
        return None
    opening = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        opening.append([m.get("role"), m.get("content")])
        if m.get("role") == "user":
            digest = hashlib.sha256(json.dumps(opening, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
            return f"conversation:{digest[:32]}"
    return None
