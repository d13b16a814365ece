"""A canary step's live figures from Prometheus: every champion replica's requests, not only those of the one
replica a `GET /-/rayline/canary` reaches (serve/online/canary_split.py).

Each champion replica's middleware counts its live requests and observes their time to first byte and inter-token
latency in Ray metrics (`rayline_canary_*`, core/metrics.py). Ray hands a replica's values to its node's agent
every report interval (2 s for replicas: serve/online/app.py), and Prometheus scrapes the agents. A step that ran from
`t0` to `t1` is judged on how much those series grew between the instants `t0 + lag_s` and `t1 + lag_s`, as
Prometheus stored them: `lag_s` (report interval + scrape interval + margin) after the split was set, everything
recorded before it has been scraped, and the split does not change until the later instant has passed, so the
window holds this step's requests only. The window's true bounds are the scrapes that were read (returned as
`window`), each up to one report interval behind.

Series are per process (Ray labels each with its worker), so a replica that started in the window counts from
zero and one that restarted (counters reset) counts its new values, as Prometheus's own `increase()` does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from core import metrics
from core import prometheus_query
from serve.online.canary_split import CHALLENGER, CHAMPION

REQUESTS = metrics.exported("rayline_canary_requests")
TTFT = metrics.exported("rayline_canary_ttft_seconds")
ITL = metrics.exported("rayline_canary_itl_seconds")
LOOKBACK = "2m"
"""How far back from an instant a series' latest sample is looked for (a replica's last report outlives it)."""

Labels = frozenset


def samples_at(url: str, expr: str, at: float) -> dict[Labels, tuple[float, float]]:
    """Each series of `expr` -> (time, value) of its latest sample at or before `at`."""
    out = {}
    for s in prometheus_query.api(url, "query", {"query": f"{expr}[{LOOKBACK}]", "time": f"{at:.3f}"})["result"]:
        t, v = s["values"][-1]
        out[Labels(s["metric"].items())] = (float(t), float(v))
    return out


def increase(before: dict[Labels, tuple[float, float]], after: dict[Labels, tuple[float, float]]) -> dict[Labels, float]:
    """How much each counter series grew between the two instants: a series new in the window (or reset: its
    process restarted) counts from zero."""
    out = {}
    for key, (_, v1) in after.items():
        v0 = before.get(key, (0.0, 0.0))[1]
        out[key] = v1 - v0 if v1 >= v0 else v1
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's `histogram_quantile` over cumulative bucket counts (upper bound -> count): linear within the
    bucket that holds the rank; the largest finite bound when the rank falls in +Inf; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def window(url: str, app: str, start: float, end: float) -> dict[str, Any]:
    """Per side (champion, challenger) the figures `serve.online.canary_split.summarize` gives for one replica, over
    every replica of `app`, from the growth of its series between `start` and `end` (Unix times); plus the
    scrape times actually read (`window`)."""
    selector = f'{{app="{app}"}}'
    grown: dict[str, dict[Labels, float]] = {}
    read_from, read_to = [], []
    for name, expr in (("requests", REQUESTS + selector), ("ttft", TTFT + "_bucket" + selector),
                       ("itl_sum", ITL + "_sum" + selector), ("itl_count", ITL + "_count" + selector)):
        before, after = samples_at(url, expr, start), samples_at(url, expr, end)
        grown[name] = increase(before, after)
        read_from += [t for t, _ in before.values()]
        read_to += [t for t, _ in after.values()]
    sides: dict[str, Any] = {}
    for role in (CHAMPION, CHALLENGER):
        mine = {name: [(dict(k), v) for k, v in series.items() if dict(k).get("role") == role]
                for name, series in grown.items()}
        requests = sum(v for _, v in mine["requests"])
        errors = sum(v for lab, v in mine["requests"] if lab.get("outcome") == "error")
        buckets: dict[float, float] = defaultdict(float)
        for lab, v in mine["ttft"]:
            buckets[float(lab["le"])] += v
        itl_n = sum(v for _, v in mine["itl_count"])
        sides[role] = {"requests": round(requests), "errors": round(errors),
                       "error_ratio": errors / requests if requests else 0.0,
                       "shadow": round(sum(v for lab, v in mine["requests"] if lab.get("mode") == "shadow")),
                       "ttft_p50_s": histogram_quantile(0.5, buckets), "ttft_p99_s": histogram_quantile(0.99, buckets),
                       "itl_mean_s": sum(v for _, v in mine["itl_sum"]) / itl_n if itl_n else None}
    return {"sides": sides, "window": [max(read_from, default=start), max(read_to, default=end)]}
