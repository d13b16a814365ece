"""What a stage's Ray job used: CPU-seconds and GPU-seconds of every process the job ran, attributed to the model
version it produced or evaluated.

Ray keeps no per-job CPU time (its agents export each process's CPU percentage by process name, never by job), so
the job's processes report their own. `init_ray` (core/ray_cluster.py) installs `report_this_worker` as the job's
`worker_process_setup_hook`: every worker process of the job (Ray Data tasks, Train workers and their controller,
Tune trials, batch engine actors) starts a daemon thread that, every REPORT_S seconds, sends the CPU time of the
process and of its live child processes (vLLM's engine core, compile workers) to the job's ledger actor, with the
GPU-seconds of the GPUs Ray assigned it (GPUs held x seconds). Ray never reuses a worker process for another job,
so a process's whole CPU time is the job's. The driver's own share is its CPU time since `StageUsage.start` (its own
and that of the child processes it waited for).

What can be missed: the last REPORT_S of a process killed without warning (a lost node, an actor Ray kills at
the end of a Train run), so the totals are a lower bound by at most REPORT_S per such process; processes of
other jobs (Serve replicas belong to Serve's controller: a rollout's usage is its driver's).
"""

from __future__ import annotations

import glob
import os
import threading
import time
from dataclasses import dataclass

REPORT_S = 0.5
"""How often a worker process sends its figures to the ledger (each send is one actor call, and reads /proc of the
process and its children: ~0.1 ms)."""
LOOKUP_S = 30.0
"""How long a worker looks for its job's ledger before it gives up (a job that does not meter itself)."""
HOOK = "core.usage.report_this_worker"
LEDGER_PREFIX = "rayline-usage-"
TAG_PREFIX = "rayline.usage."
STAGES = ("data", "tune", "train", "dpo", "grpo", "eval", "rollout")
"""The stages whose usage a model version can carry, in pipeline order (`rayline.usage.<stage>_cpu_s`)."""


@dataclass(frozen=True)
class Usage:
    cpu_s: float = 0.0
    """CPU seconds of every process of the job (the driver's from the meter's start)."""
    gpu_s: float = 0.0
    """Seconds x GPUs Ray assigned to the job's workers."""
    processes: int = 0
    driver_cpu_s: float = 0.0
    """The driver's share of cpu_s."""

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.cpu_s + other.cpu_s, self.gpu_s + other.gpu_s, self.processes + other.processes,
                     self.driver_cpu_s + other.driver_cpu_s)

    def share(self, fraction: float) -> "Usage":
        return Usage(self.cpu_s * fraction, self.gpu_s * fraction, self.processes, self.driver_cpu_s * fraction)

    def metrics(self) -> dict[str, float]:
        """The run's metrics: `usage/cpu_s`, `usage/gpu_s`, `usage/driver_cpu_s`, `usage/processes`."""
        return {"usage/cpu_s": self.cpu_s, "usage/gpu_s": self.gpu_s, "usage/driver_cpu_s": self.driver_cpu_s,
                "usage/processes": float(self.processes)}

    def tags(self, stage: str) -> dict[str, str]:
        """A model version's tags for one stage: `rayline.usage.<stage>_cpu_s` and `_gpu_s`."""
        if stage not in STAGES:
            raise ValueError(f"usage stage {stage!r}: one of {', '.join(STAGES)}")
        return {f"{TAG_PREFIX}{stage}_cpu_s": f"{self.cpu_s:.1f}", f"{TAG_PREFIX}{stage}_gpu_s": f"{self.gpu_s:.1f}"}


def descendants(pid: int) -> list[int]:
    """The live descendants of a process, from /proc/<pid>/task/<tid>/children (no scan of every process)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(children) as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:  # the task ended meanwhile
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and of all its descendants, live ones and those they waited for."""
    import psutil

    pid = pid or os.getpid()
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            t = psutil.Process(p).cpu_times()
        except psutil.Error:  # ended between the listing and the read: its waiter counts it from now on
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def driver_cpu_s() -> float:
    """User + system CPU seconds of this process and of the child processes it waited for. A driver's live children
    are left out: a driver started in a process that also started the local stack (a test, a notebook) would
    otherwise count the whole stack."""
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _assigned_gpus() -> int:
    import ray

    try:
        return len(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
    except Exception:  # not a worker (any more)
        return 0


def ledger_name(job_id: str) -> str:
    return LEDGER_PREFIX + job_id


def report_this_worker() -> None:
    """The job's `worker_process_setup_hook`: start this process's reporter thread."""
    threading.Thread(target=_report_forever, name="rayline-usage", daemon=True).start()


def _report_forever() -> None:
    import ray

    ctx = ray.get_runtime_context()
    key = f"{ctx.get_node_id()}:{os.getpid()}"
    name, ledger = ledger_name(ctx.get_job_id()), None
    gpu_s, last, give_up = 0.0, time.monotonic(), time.monotonic() + LOOKUP_S
    while True:  # a first report at once: a process that lives less than REPORT_S is counted too
        now = time.monotonic()
        gpu_s += _assigned_gpus() * (now - last)
        last = now
        try:
            if ledger is None:
                ledger = ray.get_actor(name)
            ledger.report.remote(key, process_cpu_s(), gpu_s)
        except ValueError:  # no ledger (yet): this job does not meter itself, or it has not started the ledger
            if now > give_up:
                return
        except Exception:  # Ray shut down in this process, or the ledger is gone with its driver
            return
        time.sleep(REPORT_S)


def _ledger_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=1)
    class Ledger:
        """The last figures each process of the job reported, by `<node id>:<pid>`."""

        def __init__(self):
            self.seen: dict[str, tuple[float, float]] = {}

        @ray.method(enable_task_events=False)  # twice a second per process: kept out of the job's task list
        def report(self, key: str, cpu_s: float, gpu_s: float) -> None:
            self.seen[key] = (cpu_s, gpu_s)

        def totals(self) -> tuple[float, float, int]:
            return (sum(c for c, _ in self.seen.values()), sum(g for _, g in self.seen.values()), len(self.seen))

    return Ledger


class StageUsage:
    """Meter this job from `start()` (after `init_ray`) to `totals()`: the driver's CPU time since start plus every
    worker process's, as the ledger holds them."""

    def __init__(self, ledger, driver_start_s: float):
        self._ledger, self._driver_start_s = ledger, driver_start_s

    @classmethod
    def start(cls) -> "StageUsage":
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ctx = ray.get_runtime_context()
        # On the driver's node: the job goes on when a worker node is lost (an elastic run, a batch engine's node), so
        # must its ledger. Not waited for: its process starts beside the job's first tasks, whose reporters look for
        # it for LOOKUP_S and send running totals, so nothing they did before it was up is lost.
        ledger = _ledger_class().options(
            name=ledger_name(ctx.get_job_id()), get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=True)).remote()
        return cls(ledger, driver_cpu_s())

    def totals(self) -> Usage:
        """The job's usage so far; waits one report interval so each live process's latest figures are in. Metering
        never fails a stage: with the ledger gone (its node lost) only the driver's own time is counted, and it says so."""
        import ray

        time.sleep(REPORT_S + 0.1)
        try:
            cpu_s, gpu_s, processes = ray.get(self._ledger.totals.remote(), timeout=60)
        except Exception as e:  # the actor died with its node, or cannot answer
            print(f"usage: the job's ledger did not answer ({type(e).__name__}): only the driver's CPU time is counted",
                  flush=True)
            cpu_s, gpu_s, processes = 0.0, 0.0, 0
        driver = driver_cpu_s() - self._driver_start_s
        return Usage(cpu_s + driver, gpu_s, processes + 1, driver)


def version_usage(tags: dict[str, str]) -> dict[str, Usage]:
    """The usage a model version's tags carry, by stage."""
    out = {}
    for stage in STAGES:
        cpu, gpu = tags.get(f"{TAG_PREFIX}{stage}_cpu_s"), tags.get(f"{TAG_PREFIX}{stage}_gpu_s")
        if cpu is not None:
            out[stage] = Usage(float(cpu), float(gpu or 0.0))
    return out


def inherited(parent_tags: dict[str, str]) -> dict[str, Usage]:
    """What building a version's parent cost, from the parent's tags: its data, tune, train and post-training stages,
    not its eval or rollout (those were the parent's own). A post-trained version carries it beside its own stage."""
    return {k: u for k, u in version_usage(parent_tags).items() if k not in ("eval", "rollout")}


def total_tags(by_stage: dict[str, Usage]) -> dict[str, str]:
    """`rayline.usage.total_cpu_s` / `_gpu_s`: the sum over the stages a version carries."""
    total = sum(by_stage.values(), Usage())
    return {f"{TAG_PREFIX}total_cpu_s": f"{total.cpu_s:.1f}", f"{TAG_PREFIX}total_gpu_s": f"{total.gpu_s:.1f}"}


def of_run(run_id: str) -> Usage | None:
    """The usage a stage logged on its MLflow run (None: none logged)."""
    from core import registry

    m = registry.client().get_run(run_id).data.metrics
    if "usage/cpu_s" not in m:
        return None
    return Usage(m["usage/cpu_s"], m.get("usage/gpu_s", 0.0), int(m.get("usage/processes", 0)),
                 m.get("usage/driver_cpu_s", 0.0))


def record(stage: str, used: Usage, run_id: str | None, model: str = "", version: str = "") -> None:
    """`used` on the stage's MLflow run (`usage/*` metrics) and in Prometheus (rayline_stage_cpu_seconds and
    rayline_stage_gpu_seconds by stage, model and version: for the data stage, the dataset version)."""
    from core import metrics, registry

    if run_id:
        registry.client().log_batch(run_id, metrics=[_metric(k, v) for k, v in used.metrics().items()])
    metrics.inc("rayline_stage_cpu_seconds", used.cpu_s, stage=stage, model=model, version=version)
    metrics.inc("rayline_stage_gpu_seconds", used.gpu_s, stage=stage, model=model, version=version)


def _metric(key: str, value: float):
    from mlflow.entities import Metric

    return Metric(key, value, int(time.time() * 1000), 0)


def tag_version(name: str, version: str | int, stage: str, used: Usage, upstream: dict[str, Usage] | None = None) -> None:
    """Put a stage's usage (and that of the stages upstream of it, e.g. the data its training read) on a model
    version, with the total over every stage the version carries. Tags for people, nothing decides on them: a role
    that may not write the version (the evaluator on a production model) leaves them off, with a note."""
    from core import registry

    tags = registry.client().get_model_version(name, str(version)).tags
    adding = dict(upstream or {})
    adding[stage] = adding.get(stage, Usage()) + used  # a stage also upstream (GRPO of a GRPO version): both runs
    new = {k: v for s, u in adding.items() for k, v in u.tags(s).items()}
    registry.set_display_tags(name, version, {**new, **total_tags({**version_usage(tags), **adding})})
