"""The node of one engine replica lost under load (tests/serve/test_node_loss.py; bench/bench_faults.py prints it).

    serve_node_loss(stack_cfg, model_dir)   deploy on two worker nodes, load it, lose worker-1, bring it back
    handled_by(stack_cfg, app)              which replica finished each request, from Serve's access lines
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import registry
from tests.serve.load import REQUEST_ID_PREFIX, ChatLoad, ReplicaTimeline, Request
from tests.serve.serving import deploy, node_ids_by_label, on_worker_nodes, register_fresh, serve_config_dict

NODE_LOSS_APP, NODE_LOSS_PREFIX, NODE_LOSS_MODEL = "rayline-test-node-loss", "/node-loss-test", "rayline-node-loss-test"
_ACCESS_LINE = re.compile(rf"\b({REQUEST_ID_PREFIX}[0-9a-f]{{20}})\b.* -- .*?\b(\d{{3}}|OK|ERROR) [\d.]+ms$", re.M)


def handled_by(cfg, app: str) -> dict[str, list[tuple[str, str]]]:
    """Request id -> [(replica log file, status)] of every request a replica of `app` finished, from Serve's access
    log lines in the stack's replica logs (every node of a stack on this machine logs under the head's temp dir).
    A replica writes a request's line when the request ends, whatever its status; one killed mid-request writes
    none for it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for log in sorted(Path(cfg.ray_temp_dir).glob("session_*/logs/serve/replica_*.log")):
        if app not in log.name:
            continue
        for m in _ACCESS_LINE.finditer(log.read_text(errors="replace")):
            out.setdefault(m.group(1), []).append((log.name, m.group(2)))
    return out


@dataclass
class NodeLoss:
    """What happened when worker-1 was lost under load: every request (times relative to time.monotonic()), when
    the node was killed, back, and the app at full capacity again (None: not within the limit), the replicas'
    nodes before and after, and the replica timeline."""

    streams: int
    requests: list[Request]
    killed_at: float
    joined_at: float
    recovered_at: float | None
    nodes_before: dict[str, str]
    nodes_after: dict[str, str]
    placed: dict[str, str]
    replaced: dict[str, str]
    lost_replica: str
    events: list = field(default_factory=list)
    timeline_started: float = 0.0
    handled: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """Request id -> [(replica log file, status)]: the replicas that finished it (`handled_by`)."""
    streamed: bool = False

    @property
    def noticed_at(self) -> float | None:
        """When Serve's controller reported the lost replica STOPPING or GONE (time.monotonic())."""
        times = [t for t, rid, state in self.events
                 if self.lost_replica.endswith(rid) and state in ("STOPPING", "GONE")]
        return self.timeline_started + min(times) if times and self.lost_replica else None

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    @property
    def failed_unanswered(self) -> list[Request]:
        """Failed requests that had received no byte of an answer: another replica could have taken each."""
        return [r for r in self.failed if r.answer_began is None]

    def summary(self) -> dict:
        return {
            "streams": self.streams, "streamed": self.streamed, "requests": len(self.requests),
            "failed": len(self.failed), "failed_in_flight_at_kill": sum(r.start < self.killed_at for r in self.failed),
            "failed_with_no_byte": len(self.failed_unanswered),
            "replica_marked_down_s": None if self.noticed_at is None else round(self.noticed_at - self.killed_at, 1),
            "node_rejoined_s": round(self.joined_at - self.killed_at, 1),
            "full_capacity_s": None if self.recovered_at is None else round(self.recovered_at - self.killed_at, 1),
            "failed_started_s": [round(r.start - self.killed_at, 1) for r in self.failed],
            "errors": sorted({r.error[:120] for r in self.failed}),
        }


def serve_node_loss(cfg, model_dir: str | Path, streams: int = 6, warm_s: float = 8.0,
                    recover_limit_s: float = 300.0, stream: bool = False) -> NodeLoss:
    """Deploy the tiny model with `python -m pipelines.serve`, two replicas pinned to worker-1 and worker-2 of the
    stack `cfg` (1-CPU nodes: one replica each); put `streams` loopback streams on it (each answer streamed with
    `stream`); after `warm_s` lose worker-1 (`stack_faults.kill_node`) and bring a fresh one back
    (`stack.up(parts=["nodes"])`, as KubeRay replaces a pod); wait until two replicas serve again with the lost one
    gone, keep the load `warm_s` more, and remove the app."""
    from stack import faults as stack_faults, lifecycle as stack
    from serve.promotion.deploy_target import LocalServe

    (version,) = register_fresh(NODE_LOSS_MODEL, [(str(model_dir), {})])
    registry.set_alias(NODE_LOSS_MODEL, "champion", version)
    target = LocalServe(NODE_LOSS_APP)
    try:
        # Each replica logs every request it finishes with its id (access log, written at once): which replica
        # handled each request (`handled_by`).
        deploy(on_worker_nodes({**serve_config_dict(NODE_LOSS_APP, NODE_LOSS_PREFIX, NODE_LOSS_MODEL), "access_log": True,
                                "runtime_env": {"env_vars": {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}}}))
        before = node_ids_by_label(cfg)
        load = ChatLoad(f"http://127.0.0.1:{cfg.serve_port}{NODE_LOSS_PREFIX}/v1", streams, stream=stream)
        with ReplicaTimeline(target) as timeline:
            if not timeline.wait_for(lambda t: t.running == 2, 240):
                raise RuntimeError(f"the two replicas did not start: {timeline.events}")
            placed = dict(timeline.nodes)
            lost = [rid for rid, node in placed.items() if node == before.get("worker-1")]
            with load:
                time.sleep(warm_s)
                killed_at = time.monotonic()
                stack_faults.kill_node(cfg, 1)
                stack.up(cfg, parts=["nodes"])
                joined_at = time.monotonic()
                gone = lost[0] if lost else ""
                recovered = timeline.wait_for(lambda t: t.running == 2 and gone not in t.running_ids(), recover_limit_s)
                recovered_at = time.monotonic() if recovered else None
                replaced = dict(timeline.nodes)
                time.sleep(warm_s)  # the replaced pair under the same load
        loss = NodeLoss(streams, sorted(load.requests, key=lambda r: r.start), killed_at, joined_at, recovered_at,
                        before, node_ids_by_label(cfg), placed, replaced, gone, list(timeline.events), timeline.started,
                        streamed=stream)
    finally:
        target.delete()
    # Read once the replicas have stopped: a replica's access lines may be buffered until then.
    deadline = time.time() + 120
    while target.state().status != "NOT_STARTED" and time.time() < deadline:
        time.sleep(1)
    loss.handled = handled_by(cfg, NODE_LOSS_APP)
    return loss
