"""rayline's own metrics, through Ray's metrics API (`ray.util.metrics`).

Every Ray process (a job's driver, a Train worker, a Ray Data task, a Serve replica) hands its metrics to its
node's metrics agent, which serves them to Prometheus beside Ray's, Ray Serve's and vLLM's own (the local
stack's Prometheus finds every node through Ray's service-discovery file; on Kubernetes, a PodMonitor).
Ray prefixes every name with `ray_` and counters get `_total`, so `rayline_data_records_read` below is
`ray_rayline_data_records_read_total` in Prometheus; `exported()` gives that name.

Labels are bounded: a stage's run (MLflow run id or dataset version), model name and version, and fixed
vocabularies (reject reason, error code, split, outcome). Never request ids, prompts or paths.

What Ray keeps, and so how each kind is used: a process's counters and histograms stay exported for as long
as its node lives (a finished job's counts remain), but a gauge value disappears ~2 report intervals (~20 s)
after it was last set, even while its process lives. So `gauge()` re-sets every value this process has set,
every few seconds, from a daemon thread: a replica's `served_version` stays visible as long as the replica,
a run's loss as long as its worker. Facts about a finished run (a data run's wall time, a rollout's) are
histograms: they outlive the process that observed them.

Ray hands a process's values to its node's agent every `metrics_report_interval_ms` (10 s by default) and sends
nothing more when the process is killed: a Train worker is killed once its function returns, so the last
values it set (a run's final step) would never reach Prometheus. Such a process calls `flush()` before it
returns: it waits until one report has gone out since its last record. Train workers report every
REPORT_INTERVAL_MS instead, so that wait is short. A driver that exits normally reports on its way out.

Recording is a no-op in a process that is not connected to Ray (a unit test calling a stage's helpers, a
rollout run from a laptop against a remote cluster): metrics describe work done on a cluster.
"""

from __future__ import annotations

import threading
import os
import time
from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
REFRESH_S = 5.0
"""How often this process re-sets its gauges (Ray drops a gauge not set for ~2 report intervals)."""
REPORT_INTERVAL_MS = 2000
RAY_DEFAULT_REPORT_INTERVAL_MS = 10_000  # ray_config_def.h metrics_report_interval_ms
"""`RAY_metrics_report_interval_ms` of processes that must flush before they end (Train workers)."""
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
"""Close enough at the low end for a canary step's TTFT p50/p99 ratios (serve/promotion/canary_metrics.py interpolates)."""
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)


@dataclass(frozen=True)
class Metric:
    kind: str
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...] = ()


_DATA = ("dataset", "version")
_TRAIN = ("run", "model")
_BATCH = ("run", "model", "mode")
METRICS: dict[str, Metric] = {
    # data/ (the driver, once the manifest is written)
    "rayline_data_records_read": Metric(COUNTER, "Input records read by the data stage.", _DATA),
    "rayline_data_records_rejected": Metric(COUNTER, "Records rejected by the data stage, by reason.", (*_DATA, "reason")),
    "rayline_data_records_deduplicated": Metric(COUNTER, "Exact duplicates the data stage dropped.", _DATA),
    "rayline_data_tokens_written": Metric(COUNTER, "Tokens written to the dataset, by split.", (*_DATA, "split")),
    "rayline_data_duration_seconds": Metric(HISTOGRAM, "Wall time of data stage runs.", _DATA, DURATION_BUCKETS),
    # train/ (rank 0 of the Train worker group; Tune trials too)
    "rayline_train_loss": Metric(GAUGE, "Training loss (per loss token) of the last logged step.", _TRAIN),
    "rayline_train_eval_loss": Metric(GAUGE, "Loss on the eval split at the last evaluation.", _TRAIN),
    "rayline_train_tokens_per_second": Metric(GAUGE, "Tokens per second of the last logged step, all workers.", _TRAIN),
    "rayline_train_step_seconds": Metric(GAUGE, "Wall time of the last logged optimizer step.", _TRAIN),
    "rayline_train_mfu_ratio": Metric(GAUGE, "Model FLOPs utilization estimate of the last logged step "
                                              "(6 x parameters x tokens/s over the workers' peak FLOP/s).", _TRAIN),
    "rayline_train_step": Metric(GAUGE, "Optimizer steps done.", _TRAIN),
    "rayline_train_steps_planned": Metric(GAUGE, "Optimizer steps the run will take.", _TRAIN),
    "rayline_train_checkpoint_save_seconds": Metric(GAUGE, "Time rank 0 took to save and report the last checkpoint.",
                                                    _TRAIN),
    "rayline_train_restarts": Metric(COUNTER, "Times the worker group resumed the run from a checkpoint.", _TRAIN),
    # posttrain/grpo/ (the GRPO driver, after each policy update)
    "rayline_grpo_reward_mean": Metric(GAUGE, "Mean verifier reward of the last update's samples.", _TRAIN),
    "rayline_grpo_reward_std": Metric(GAUGE, "Spread (standard deviation) of the last update's rewards.", _TRAIN),
    "rayline_grpo_kl": Metric(GAUGE, "Mean KL to the reference of the last update (0 with beta 0).", _TRAIN),
    "rayline_grpo_rollout_tokens_per_second": Metric(GAUGE, "Tokens per second the rollout engines generated for "
                                                            "the last update.", _TRAIN),
    "rayline_grpo_weight_sync_seconds": Metric(GAUGE, "Seconds the last weight update into the rollout engines "
                                                      "took (gather included).", _TRAIN),
    "rayline_grpo_policy_lag": Metric(GAUGE, "Policy steps the last update's samples lagged the trained policy.",
                                      _TRAIN),
    "rayline_grpo_prompts_consumed": Metric(GAUGE, "Prompts the run has consumed (its cursor).", _TRAIN),
    "rayline_grpo_step": Metric(GAUGE, "Policy updates done.", _TRAIN),
    # serve/batch/ (the result tasks count rows as they are written; the driver sets the total)
    "rayline_batch_rows_done": Metric(COUNTER, "Rows answered or refused by the batch stage.", _BATCH),
    "rayline_batch_rows_planned": Metric(GAUGE, "Rows in the batch stage's input.", _BATCH),
    "rayline_batch_row_errors": Metric(COUNTER, "Rows with an error, by error code.", (*_BATCH, "code")),
    "rayline_batch_output_tokens": Metric(COUNTER, "Tokens generated by the batch stage.", _BATCH),
    # serve/ (each engine replica)
    "rayline_served_version": Metric(GAUGE, "1 for each model version a live replica serves (info metric).",
                                     ("app", "served_model", "model", "version")),
    "rayline_served_adapter_version": Metric(GAUGE, "1 for each LoRA adapter version a live replica answers with, 0 "
                                                    "once superseded or dropped (info metric).",
                                             ("app", "served_model", "adapter", "model", "version")),
    "rayline_serve_requests": Metric(COUNTER, "HTTP requests answered by a replica, by served version and status "
                                              "code.", ("app", "model", "version", "code")),
    "rayline_canary_requests": Metric(COUNTER, "Live requests of a canary by the side that answered them (champion, "
                                               "challenger; mode live or shadow) and outcome.",
                                      ("app", "role", "mode", "outcome")),
    "rayline_canary_ttft_seconds": Metric(HISTOGRAM, "Time to first byte of a canary's live requests, by side.",
                                          ("app", "role"), LATENCY_BUCKETS),
    "rayline_canary_itl_seconds": Metric(HISTOGRAM, "Mean gap between the streamed chunks of a canary's live answers "
                                                    "(inter-token latency), by side.", ("app", "role"), ITL_BUCKETS),
    # core/usage.py (each stage's driver, once its job's usage is known)
    "rayline_stage_cpu_seconds": Metric(COUNTER, "CPU seconds a stage's Ray job used (all its processes), by the "
                                                 "model version it produced or evaluated (data: the dataset version).",
                                        ("stage", "model", "version")),
    "rayline_stage_gpu_seconds": Metric(COUNTER, "GPU seconds (GPUs held x seconds) of a stage's Ray job, by model "
                                                 "version.", ("stage", "model", "version")),
    # serve/promotion/rollout.py (a rollout run on the cluster: a Ray job or the rendered RayJob)
    "rayline_rollouts": Metric(COUNTER, "Rollouts by outcome (deployed, rejected at the gate, rolled_back, ...).",
                               ("model", "outcome")),
    "rayline_rollout_duration_seconds": Metric(HISTOGRAM, "Rollout wall time: alias seen -> new version answering, "
                                                          "or -> rolled back.", ("model", "outcome"), DURATION_BUCKETS),
}

_made: dict[str, object] = {}
_lock = threading.Lock()
_kept: dict[tuple[str, frozenset], tuple[dict[str, str], float]] = {}
_last_recorded: float | None = None
_refresher: threading.Thread | None = None


def exported(name: str) -> str:
    """The name Prometheus sees (Ray's `ray_` prefix; `_total` on counters; a histogram's series add
    `_bucket`, `_sum` and `_count` to it)."""
    return "ray_" + name + ("_total" if METRICS[name].kind == COUNTER else "")


def defined_as(series: str) -> str | None:
    """The METRICS name behind an exported series name (`ray_rayline_x_total`, `..._bucket`, ...), else None."""
    for name, m in METRICS.items():
        base = exported(name)
        suffixes = ("_bucket", "_sum", "_count") if m.kind == HISTOGRAM else ("",)
        if any(series == base + suffix for suffix in suffixes):
            return name
    return None


def _connected() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized()


def _metric(name: str):
    global _last_recorded
    with _lock:
        _last_recorded = time.monotonic()
        if name not in _made:
            from ray.util.metrics import Counter, Gauge

            from ray.util.metrics import Histogram

            m = METRICS[name]
            if m.kind == HISTOGRAM:
                _made[name] = Histogram(name, description=m.description, boundaries=list(m.boundaries),
                                        tag_keys=m.tags)
            else:
                _made[name] = (Counter if m.kind == COUNTER else Gauge)(name, description=m.description,
                                                                        tag_keys=m.tags)
        return _made[name]


def _tags(name: str, tags: dict[str, object]) -> dict[str, str]:
    want = METRICS[name].tags
    if set(tags) != set(want):
        raise ValueError(f"metric {name}: tags {sorted(tags)} given, {sorted(want)} expected")
    return {k: str(v) for k, v in tags.items()}


def _checked(name: str, kind: str, tags: dict[str, object]) -> dict[str, str]:
    """The tags as strings, once the metric is of `kind` and they are exactly its label set."""
    if METRICS[name].kind != kind:
        raise ValueError(f"metric {name} is a {METRICS[name].kind}, not a {kind}")
    return _tags(name, tags)


def inc(name: str, value: float = 1.0, **tags) -> None:
    """Add `value` to a counter (nothing to add when it is 0)."""
    tags = _checked(name, COUNTER, tags)
    if value < 0:
        raise ValueError(f"metric {name}: a counter only grows, got {value}")
    if value > 0 and _connected():
        _metric(name).inc(float(value), tags=tags)


def gauge(name: str, value: float, **tags) -> None:
    """Set a gauge; this process keeps re-setting it (every REFRESH_S) so it stays exported while it lives."""
    tags = _checked(name, GAUGE, tags)
    if _connected():
        _metric(name).set(float(value), tags=tags)
        with _lock:
            _kept[(name, frozenset(tags.items()))] = (tags, float(value))
        _start_refresher()


def observe(name: str, value: float, **tags) -> None:
    """Add one observation to a histogram."""
    tags = _checked(name, HISTOGRAM, tags)
    if _connected():
        _metric(name).observe(float(value), tags=tags)


def report_interval_s() -> float:
    """This process's metrics report interval: RAY_metrics_report_interval_ms, which rayline sets on the processes
    that flush (train/trainer.py `worker_env`, serve/online/served_model.py REPLICA_METRICS_ENV), else Ray's default, 10 s."""
    return int(os.environ.get("RAY_metrics_report_interval_ms", RAY_DEFAULT_REPORT_INTERVAL_MS)) / 1000


def flush() -> float:
    """Wait until Ray has reported this process's metrics once since the last record (a report interval after
    it, plus a margin); returns the seconds waited. For processes that are killed rather than exit."""
    if _last_recorded is None or not _connected():
        return 0.0
    wait = _last_recorded + report_interval_s() + 1.0 - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    return max(0.0, wait)


def _start_refresher() -> None:
    global _refresher
    with _lock:
        if _refresher is not None and _refresher.is_alive():
            return
        _refresher = threading.Thread(target=_refresh_forever, name="rayline-metrics-refresh", daemon=True)
        _refresher.start()


def _refresh_forever() -> None:
    while True:
        time.sleep(REFRESH_S)
        with _lock:
            kept = [(name, tags, value) for (name, _), (tags, value) in _kept.items()]
        try:
            for name, tags, value in kept:
                _metric(name).set(value, tags=tags)
        except Exception:  # Ray shut down in this process: nothing left to export to
            return
