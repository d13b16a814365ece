"""The Prometheus HTTP API client the canary, the tests, the demo and the dashboards' checks use."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request


def api(url: str, path: str, params: dict | None = None, timeout: float = 10) -> dict:
    """GET `url/api/v1/<path>`; the `data` of a successful answer, else a ValueError with Prometheus's error."""
    full = f"{url.rstrip('/')}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    try:
        with urllib.request.urlopen(full, timeout=timeout) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    return body["data"]


def query(url: str, expr: str) -> list[dict]:
    """Instant query: the result vector (a list of {"metric": labels, "value": [t, v]})."""
    data = api(url, "query", {"query": expr})
    return data["result"] if data["resultType"] in ("vector", "matrix") else [{"metric": {}, "value": data["result"]}]


def wait_for(url: str, expr: str, timeout_s: float = 60, every_s: float = 1.0) -> list[dict]:
    """Poll `expr` until it returns series (a scrape or two after a metric is first written)."""
    deadline = time.time() + timeout_s
    while True:
        result = query(url, expr)
        if result or time.time() > deadline:
            return result
        time.sleep(every_s)


def query_range(url: str, expr: str, start: float, end: float, step_s: float = 15) -> list[dict]:
    """Range query: the result matrix (a list of {"metric": labels, "values": [[t, v], ...]})."""
    return api(url, "query_range", {"query": expr, "start": start, "end": end, "step": step_s})["result"]


def targets(url: str) -> list[dict]:
    """Active scrape targets: job, scrape URL, health and last error."""
    return [{"job": t["labels"].get("job"), "url": t["scrapeUrl"], "health": t["health"], "error": t["lastError"]}
            for t in api(url, "targets")["activeTargets"]]
