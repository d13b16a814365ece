"""Jobs that say why they wait: a stage that waits for resources prints what it asked for, what the cluster has
free, what holds the rest and whether an autoscaler can add nodes, and fails at `max_wait_s` instead of waiting
forever.

    with ResourceWatch("batch_infer", max_wait_s=cfg.max_wait_s):    # after init_ray()
        run_pipeline(...)

A wait is work of this job (or, for a Serve deploy, of one app's replicas) that Ray has not placed: a task
pending node assignment, an actor pending creation, a placement group pending. Work pending for
`report_after_s` (10 s) is reported, well inside 30 s of the wait's start, then again every `repeat_s` while it
lasts. Everything is read from Ray's public state API (`ray.util.state`: tasks, actors, placement groups, jobs)
and `ray.available_resources()`; two reads are private and listed in docs/INTERNALS.md: the free CPUs per node
(P3, `core.ray_cluster`) and the autoscaler's node groups, which Ray keeps in the GCS
(`ray._private.state.state.get_cluster_config()`, the read Ray Data and Ray Train use for the same question).
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

REPORT_AFTER_S = 10.0
"""Work pending this long is a wait (a replica or an engine normally takes a moment to be placed)."""
POLL_S = 2.0
GAP_S = 15.0
"""A wait goes on through a gap this short with nothing pending: Ray Train gives up on a placement group it cannot
place (after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) and asks again with a new one."""
REPEAT_S = 60.0
"""While a wait lasts, the report is printed again this often (with the figures of the moment)."""
IGNORED = ("memory", "object_store_memory")
"""Resources every node has plenty of for rayline's asks; listing them would bury the one that is short."""
SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"
"""Ray Serve names a replica's actor, and its placement group, `SERVE_REPLICA::<app>#<deployment>#<id>`."""


class ResourceWaitTimeout(RuntimeError):
    """The stage waited `max_wait_s` for resources; the message is the wait report."""


@dataclass
class Pending:
    what: str
    """e.g. `task MapBatches(result_rows)`, `actor EngineStageUDF`, `placement group (train workers)`."""
    resources: dict[str, float]
    since: float = 0.0


@dataclass
class WaitReport:
    stage: str
    waited_s: float
    asked: list[Pending]
    free: dict[str, float]
    free_per_node: list[float]
    """Free CPUs of each alive node, largest first (a task takes its CPUs from one node)."""
    total: dict[str, float]
    holders: dict[str, dict[str, float]]
    """Who holds resources -> what: `Serve app rayline`, `job 03000000 (raysubmit_..: python -m ...)`, `this job`."""
    autoscaler: str
    max_wait_s: float = 0.0

    def message(self) -> str:
        asked = add_up(p.resources for p in self.asked)
        items = "; ".join(f"{p.what} {fmt(p.resources)}" for p in self.asked[:4])
        more = f"; and {len(self.asked) - 4} more" if len(self.asked) > 4 else ""
        per_node = f" (per node: {', '.join(f'{c:g}' for c in self.free_per_node)} CPU)" if len(self.free_per_node) > 1 else ""
        held = "; ".join(f"{who} {fmt(res)}" for who, res in self.holders.items()) or "nothing rayline can see"
        limit = (f"; fails at max_wait_s={self.max_wait_s:g}" if self.max_wait_s else
                 "; no max_wait_s set: it waits until resources free up")
        return "\n".join([
            f"{self.stage}: waiting {self.waited_s:.0f}s for resources{limit}",
            f"  asked:      {fmt(asked)} pending: {items}{more}",
            f"  free:       {fmt(self.free, keys=self.total)} of {fmt(self.total)}{per_node}",
            f"  held by:    {held}",
            f"  autoscaler: {self.autoscaler}",
            "  to go on:   free resources (e.g. `python -m pipelines.serve -c CONFIG --delete` removes a Serve app, "
            "`ray job stop ID` a job), lower this stage's CPU settings, or add nodes",
        ])


def fmt(resources: dict[str, float], keys: dict[str, float] | None = None) -> str:
    """`{CPU: 1.5, GPU: 1}`; with `keys`, each of those resources shown, at 0 where `resources` lacks it (Ray leaves a
    resource out of `available_resources()` once none of it is free)."""
    if keys is not None:
        resources = {k: resources.get(k, 0.0) for k in keys}
    shown = {k: v for k, v in sorted(resources.items())
             if (v or keys is not None) and k not in IGNORED and not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def add_up(items) -> dict[str, float]:
    total: dict[str, float] = {}
    for resources in items:
        for k, v in (resources or {}).items():
            if k in IGNORED or k.startswith("node:") or "_group_" in k:
                continue  # placement-group bundle markers and per-node markers are not what anyone asked for
            total[k] = round(total.get(k, 0.0) + float(v), 6)
    return total


def _state(address: str | None):
    """`ray.util.state`'s list calls bound to `address` (None: the Ray this process joined)."""
    from ray.util import state

    def listing(fn, **kwargs):
        return fn(address=address, raise_on_missing_output=False, timeout=10, **kwargs)
    return state, listing


def pending_work(job_id: str | None = None, name_prefix: str | None = None, address: str | None = None) -> dict[str, Pending]:
    """What Ray has not placed yet, by id: tasks pending node assignment, actors pending creation (outside a
    placement group: a pending group is the ask then) and pending placement groups, of job `job_id` or whose name
    starts with `name_prefix` (a Serve app's replicas)."""
    state, listing = _state(address)

    def mine(job: str | None, name: str | None) -> bool:
        if name_prefix is not None:
            return bool(name) and name.startswith(name_prefix)
        return job == job_id

    out: dict[str, Pending] = {}
    for t in listing(state.list_tasks, filters=[("state", "=", "PENDING_NODE_ASSIGNMENT")], detail=True):
        if t.type == "NORMAL_TASK" and not t.placement_group_id and mine(t.job_id, t.name):
            out[t.task_id] = Pending(f"task {t.name}", add_up([t.required_resources]))
    for a in listing(state.list_actors, filters=[("state", "=", "PENDING_CREATION")], detail=True):
        if not a.placement_group_id and mine(a.job_id, a.name):
            out[a.actor_id] = Pending(f"actor {a.class_name}", add_up([a.required_resources]))
    for pg in listing(state.list_placement_groups, filters=[("state", "=", "PENDING")], detail=True):
        if mine(pg.creator_job_id, pg.name):
            bundles = [b.get("unit_resources") for b in pg.bundles or []]
            out[pg.placement_group_id] = Pending(f"placement group {pg.name or pg.placement_group_id[:8]} "
                                                 f"({len(bundles)} bundle(s))", add_up(bundles))
    return out


def holders(job_id: str | None = None, address: str | None = None) -> dict[str, dict[str, float]]:
    """Who holds the cluster's resources: each Serve app (its replicas and their placement groups), each job by id
    (with its submission id and entry point), Serve's own actors; `this job` for `job_id`."""
    state, listing = _state(address)
    jobs = {}
    for j in listing(state.list_jobs):
        entry = (j.entrypoint or "").strip()
        entry = entry if len(entry) <= 60 else entry[:57] + "..."
        jobs[j.job_id] = f"job {j.job_id}" + (f" ({j.submission_id}: {entry})" if j.submission_id else
                                              f" ({entry})" if entry else "")

    def who(name: str | None, job: str | None) -> str:
        if name and name.startswith(SERVE_REPLICA_PREFIX):
            return f"Serve app {name[len(SERVE_REPLICA_PREFIX):].split('#')[0]}"
        if name and name.startswith("SERVE_"):
            return "Serve's controller and proxies"
        if job_id and job == job_id:
            return "this job"
        return jobs.get(job, f"job {job}")

    held: dict[str, list[dict]] = {}
    for pg in listing(state.list_placement_groups, filters=[("state", "=", "CREATED")], detail=True):
        held.setdefault(who(pg.name, pg.creator_job_id), []).extend(b.get("unit_resources") for b in pg.bundles or [])
    for a in listing(state.list_actors, filters=[("state", "=", "ALIVE")], detail=True):
        if not a.placement_group_id:  # an actor in a group uses the group's bundle, counted above
            held.setdefault(who(a.name, a.job_id), []).append(a.required_resources)
    for t in listing(state.list_tasks, filters=[("state", "=", "RUNNING")], detail=True):
        if t.type == "NORMAL_TASK" and not t.placement_group_id:
            held.setdefault(who(None, t.job_id), []).append(t.required_resources)
    totals = {k: add_up(v) for k, v in held.items()}
    return {k: v for k, v in sorted(totals.items(), key=lambda kv: -kv[1].get("CPU", 0.0)) if any(v.values())}


def autoscaler_shapes() -> str:
    """Whether an autoscaler can add nodes, and of what shape: the node groups Ray's autoscaler (v2; KubeRay's
    in-tree autoscaler) reported to the GCS."""
    import ray

    if not ray.is_initialized():
        return "not read (this process has not joined Ray: `ray status` on the head shows it)"
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception as e:  # noqa: BLE001 -- the answer is only a line of the report
        return f"unknown ({type(e).__name__}: {e})"
    groups = [g for g in (config.node_group_configs if config else []) if g.max_count != 0]
    if not groups:
        return "none reported to Ray: the cluster will not grow; what is asked must fit what is there"
    return "can add nodes: " + "; ".join(
        f"{g.name} {fmt(dict(g.resources))} x up to {'unlimited' if g.max_count < 0 else g.max_count}"
        for g in groups)


def cluster_figures(held: dict[str, dict[str, float]], address: str | None = None
                    ) -> tuple[dict[str, float], list[float], dict[str, float]]:
    """(free, free CPUs per node largest first, total). From the Ray this process joined; in a process that has not
    (a Serve deploy through the dashboard), the alive nodes' totals less what `held` adds up to, and no per-node
    figures."""
    import ray

    if ray.is_initialized():
        from core.ray_cluster import free_cpus_per_node

        return add_up([ray.available_resources()]), free_cpus_per_node(), add_up([ray.cluster_resources()])
    state, listing = _state(address)
    total = add_up(n.resources_total for n in listing(state.list_nodes, filters=[("state", "=", "ALIVE")], detail=True))
    used = add_up(held.values())
    return {k: max(0.0, round(v - used.get(k, 0.0), 6)) for k, v in total.items()}, [], total


def wait_report(stage: str, pending: list[Pending], waited_s: float, job_id: str | None = None,
                address: str | None = None, max_wait_s: float = 0.0) -> WaitReport:
    """The figures of a wait, read now."""
    held = holders(job_id, address)
    free, per_node, total = cluster_figures(held, address)
    return WaitReport(stage=stage, waited_s=waited_s, asked=pending, free=free, free_per_node=per_node, total=total,
                      holders=held, autoscaler=autoscaler_shapes(), max_wait_s=max_wait_s)


@dataclass
class ResourceWatch:
    """A context manager that watches, on a daemon thread, for the work of this process's Ray job (or with
    `name_prefix`, of the actors and placement groups so named) waiting for resources; prints a WaitReport once a
    wait lasts `report_after_s`, and with `max_wait_s` > 0 interrupts the main thread when a wait lasts that long,
    which leaves the block as ResourceWaitTimeout carrying the report (also where a library handles the interrupt
    itself: Tune stops its trials and returns). Watching a job's work needs `ray.init` done (init_ray); watching by
    `name_prefix` does not (the state API through the dashboard at `address`, or RAY_ADDRESS)."""

    stage: str
    max_wait_s: float = 0.0
    name_prefix: str | None = None
    address: str | None = None
    report_after_s: float = REPORT_AFTER_S
    poll_s: float = POLL_S
    repeat_s: float = REPEAT_S
    print_fn: Callable[[str], None] = field(default=lambda s: print(s, flush=True))
    reports: list[WaitReport] = field(default_factory=list)
    """Every report printed (the last one is the timeout's, when there was one)."""
    polls: int = 0
    """Polls of the state API done so far, answered or not."""
    _failed: WaitReport | None = None

    def __enter__(self) -> "ResourceWatch":
        import ray

        self._job = None if self.name_prefix else ray.get_runtime_context().get_job_id()
        self._sigint = None  # the SIGINT disposition to put back on exit, where the watch replaced it
        if self.max_wait_s and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            # Python handles no SIGINT here (a process a shell started in the background, `cmd &`, inherits SIGINT
            # ignored), and `interrupt_main` does nothing then: the block would wait on past max_wait_s. Python's
            # own handler for the block's time, the previous disposition back on exit.
            self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler) or signal.SIG_DFL
        self._stop = threading.Event()
        self._inside = threading.Lock()  # held by the watcher while it interrupts: never once the block has left
        self._thread = threading.Thread(target=self._watch, name=f"{self.stage}-resource-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        with self._inside:
            self._stop.set()
        if self._failed is not None and exc_type is None:
            # The block returned after the watcher gave up: a library that handles SIGINT itself (Tune stops its
            # trials and returns) took the interrupt, or it is still on its way (take it here).
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                pass
        self._thread.join(timeout=self.poll_s + 15)
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
        if self._failed is not None:
            raise ResourceWaitTimeout(self._failed.message()) from None
        return False

    def _watch(self) -> None:
        seen: dict[str, float] = {}
        waiting_since = last_pending = last_report = 0.0
        last_error = ""
        while not self._stop.wait(self.poll_s):
            self.polls += 1
            try:
                now = time.monotonic()
                pending = pending_work(self._job, self.name_prefix, self.address)
                last_error = ""
                seen = {k: seen.get(k, now) for k in pending}  # first seen pending, for what is pending still
                if not seen:
                    if waiting_since and now - last_pending > GAP_S:
                        waiting_since = last_report = 0.0  # the wait is over
                    continue
                last_pending = now
                if not waiting_since and now - min(seen.values()) >= self.report_after_s:
                    waiting_since = min(seen.values())
                if not waiting_since:
                    continue  # work placed within moments: a busy cluster, not a wait
                waited = now - waiting_since
                timed_out = bool(self.max_wait_s) and waited >= self.max_wait_s
                if waited < self.report_after_s or (not timed_out and last_report and now - last_report < self.repeat_s):
                    continue
                for key, p in pending.items():
                    p.since = seen[key]
                asked = sorted(pending.values(), key=lambda p: p.since)
                report = wait_report(self.stage, asked, waited, self._job, self.address, self.max_wait_s)
                self.reports.append(report)
                last_report = now
                if timed_out:
                    with self._inside:
                        if self._stop.is_set():
                            return
                        self._failed = report
                        self.print_fn(report.message().replace(" for resources;", " for resources, giving up;", 1))
                        _thread.interrupt_main()
                    return
                self.print_fn(report.message())
            except Exception as e:  # noqa: BLE001 -- watching must never break the stage it watches
                error = f"{type(e).__name__}: {e}"
                if error != last_error:  # once until it changes: a Ray without its dashboard fails every poll alike
                    self.print_fn(f"{self.stage}: resource watch: {error} (the watch keeps trying; said again "
                                  "only if it changes)")
                last_error = error
