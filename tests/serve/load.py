"""Loads the Serve integration tests put on an app, bounded and on loopback, and what they watch meanwhile.

    ChatLoad(base_url, streams)             chat completions back to back, each request timed and its outcome kept
    LoadThreads(clients, target)            client threads running while a `with` block does
    ReplicaTimeline(target)                 the app's engine replicas' state changes, polled in a thread
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from tests.serve.serving import openai_client

REQUEST_ID_PREFIX = "rlt-"
"""Every ChatLoad request id starts with it (`x-request-id`), so Serve's access lines can be matched to requests."""


class ReplicaTimeline:
    """Polls the app's engine replicas and records each replica's state changes as (seconds since start, id, state);
    `nodes` maps each current replica to its Ray node id. With `watch_nodes` (-> the node ids of interest now, or
    None when unknown) it also records those nodes coming and going in `node_events`: (seconds, node id, "JOINED" or
    "LEFT")."""

    def __init__(self, target, every_s: float = 0.5, watch_nodes=None):
        self.target, self.every_s, self.watch_nodes = target, every_s, watch_nodes
        self.events: list[tuple[float, str, str]] = []
        self.node_events: list[tuple[float, str, str]] = []
        self._watched: set[str] = set()
        self.running = self.replicas = 0
        self.polled_at = 0.0  # time.monotonic() of the last poll the controller answered
        self.nodes: dict[str, str] = {}
        self._states: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.watch_nodes:
                self._poll_nodes()
            try:
                replicas = [r for r in self.target.replicas() if r["deployment"].startswith("LLMServer")]
            except Exception:  # a slow dashboard answer: the next poll catches up
                continue
            now = {r["replica_id"]: r["state"] for r in replicas}
            for rid in set(now) | set(self._states):
                state = now.get(rid, "GONE")
                if self._states.get(rid) != state:
                    self.events.append((round(time.monotonic() - self.started, 1), rid[-8:], state))
            self._states = now
            self.nodes = {r["replica_id"]: r["node_id"] for r in replicas}
            self.replicas = len(now)
            self.running = sum(1 for s in now.values() if s == "RUNNING")
            self.polled_at = time.monotonic()

    def _poll_nodes(self) -> None:
        now = self.watch_nodes()
        if now is None:  # not known this time (e.g. the dashboard did not answer)
            return
        at = self.now()
        self.node_events += [(at, n, "JOINED") for n in sorted(now - self._watched)]
        self.node_events += [(at, n, "LEFT") for n in sorted(self._watched - now)]
        self._watched = now

    def now(self) -> float:
        """Seconds since the timeline started, as its events count them."""
        return round(time.monotonic() - self.started, 1)

    def running_ids(self) -> set[str]:
        return {rid for rid, state in self._states.items() if state == "RUNNING"}

    def __enter__(self) -> "ReplicaTimeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.5)
        return False


@dataclass
class Request:
    start: float
    end: float
    ok: bool
    error: str = ""
    fingerprint: str = ""  # "<registered name>/<version>" of the engine that answered
    request_id: str = ""  # sent as `x-request-id`: Serve logs it with the replica that handled the request
    answer_began: float | None = None
    """A streamed request: when its answer began (a 200 status and headers came back, time.monotonic()); None: no
    byte of an answer came (a connection error, an error status) or the request was not streamed."""


class LoadThreads:
    """Client threads (`target(i)` each) running while the `with` block does; `stop` is set on exit and each thread
    joined, bounded."""

    def __init__(self, clients: int, target, join_s: float = 180):
        self.stop = threading.Event()
        self.join_s = join_s
        self.threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.join_s)


class ChatLoad(LoadThreads):
    """`streams` threads sending chat completions back to back over loopback (the `openai` client, no retries)
    until stopped; every request is recorded with its start and end (time.monotonic()) and outcome. With several
    base URLs (e.g. the proxies of several nodes) the streams take them in turn. With `pause_s`, each stream waits
    that long after each answer (a paced load that leaves the machine CPU for what else must run, e.g. a head
    restarting, as it would on nodes of its own). With `stream`, each answer is streamed (`stream=True`): a request
    records when its answer began (`Request.answer_began`) and is answered only if the stream ran to its finish
    reason."""

    def __init__(self, base_url: str | list[str], streams: int, max_tokens: int = 48, pause_s: float = 0.0,
                 stream: bool = False):
        super().__init__(streams, self._stream, join_s=150)
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.clients = [openai_client(u) for u in urls]
        self.max_tokens, self.pause_s, self.stream = max_tokens, pause_s, stream
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def _stream(self, i: int) -> None:
        client = self.clients[i % len(self.clients)]
        while not self.stop.is_set():
            start, error, request_id = time.monotonic(), "", f"{REQUEST_ID_PREFIX}{uuid.uuid4().hex[:20]}"
            began = None
            try:
                r = client.chat.completions.create(
                    model="rayline", messages=[{"role": "user", "content": "Count: 1 2 3"}],
                    max_tokens=self.max_tokens, extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": request_id}, stream=self.stream)
                if self.stream:  # create() returns once the 200 status and headers are in
                    began, text, finish, fingerprint = time.monotonic(), "", None, ""
                    with r:
                        for chunk in r:
                            fingerprint = chunk.system_fingerprint or fingerprint
                            for choice in chunk.choices:
                                text += choice.delta.content or ""
                                finish = choice.finish_reason or finish
                    ok = bool(text) and finish is not None
                    error = "" if ok else f"the stream ended without its finish reason after {len(text)} chars"
                else:
                    ok, fingerprint = bool(r.choices[0].message.content), r.system_fingerprint or ""
            except Exception as e:
                ok, error, fingerprint = False, f"{type(e).__name__}: {e}"[:300], ""
            with self._lock:
                self.requests.append(Request(start, time.monotonic(), ok, error, fingerprint, request_id, began))
            if self.pause_s:
                self.stop.wait(self.pause_s)

    def counts(self) -> dict[str, int]:
        with self._lock:
            ok = sum(r.ok for r in self.requests)
            return {"ok": ok, "failed": len(self.requests) - ok}
