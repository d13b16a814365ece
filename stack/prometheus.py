"""A real Prometheus server for the local stack (Debian's `prometheus` package), run from the state dir.

Everything lives under `state_dir/"prometheus"`: the config written by `prepare()`, the TSDB in `data/`,
and `ray_nodes.json`, a link to the service-discovery file Ray's head writes into its session dir (one
target per Ray node: its metrics agent, which exports Ray's, Ray Serve's, vLLM's and rayline's own
metrics). Prometheus scrapes those, the MLflow server's `/metrics` and itself, and evaluates the
project's alert rules (`observability/prometheus/alerts.yml`). It binds 127.0.0.1 only, and runs without its
lifecycle API (/-/reload, /-/quit) and admin API (TSDB deletion, snapshots): on loopback any local process could
call them unauthenticated (Prometheus re-reads its config on SIGHUP, which only the user's own processes send).

Its HTTP API client is core/prometheus_query.py.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[1]
OBSERVABILITY = PROJECT_ROOT / "observability"
RULES = OBSERVABILITY / "prometheus" / "alerts.yml"
DASHBOARDS = OBSERVABILITY / "grafana" / "dashboards"
# Grafana's own variables in the dashboards' queries, and what they become in a plain Prometheus query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
RAY_SD_FILE = "prom_metrics_service_discovery.json"
"""The file in Ray's temp dir that Ray keeps listing every node's metrics agent (the path Ray's documented
Prometheus set-up and its shipped prometheus.yml name: `/tmp/ray/prom_metrics_service_discovery.json` by default)."""
_APT = "apt-get install prometheus"


def available() -> str | None:
    """None when Prometheus can run here, else a human-readable reason."""
    for binary in ("prometheus", "promtool"):
        if shutil.which(binary) is None:
            return f"{binary} not found: {_APT} (or `make`, which installs it as root)"
    return None


def folder(state: Path) -> Path:
    return state / "prometheus"


def scrape_config(state: Path, port: int, mlflow_port: int, interval_s: float, ray_temp_dir: Path) -> dict:
    """The server's config: Ray's nodes through Ray's own discovery file in its temp dir (Ray rewrites it as nodes
    join and leave; Prometheus re-reads it every interval), MLflow, itself; the alert rules."""
    every = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "ray",
             "file_sd_configs": [{"files": [str(Path(ray_temp_dir) / RAY_SD_FILE)], "refresh_interval": every}]},
            # MLflow answers nobody without a login, and its auth app fails closed on routes it has no rule for:
            # /metrics answers its admins only (MLflow 3.17). Prometheus, a process of the stack's own user, reads
            # the admin's password file (0600) itself; the password is in no config or argv.
            {"job_name": "mlflow", "static_configs": [{"targets": [f"127.0.0.1:{mlflow_port}"]}],
             "basic_auth": {"username": "admin", "password_file": str(state / "credentials" / "admin" / "password")}},
            {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        ],
    }


def prepare(state: Path, port: int, mlflow_port: int, interval_s: float, ray_temp_dir: Path) -> list[str]:
    """Write the config under the state dir; return the server's argv (foreground, logs on stderr, no lifecycle
    or admin API)."""
    root = folder(state)
    (root / "data").mkdir(parents=True, exist_ok=True)
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(state, port, mlflow_port, interval_s, ray_temp_dir), sort_keys=False))
    return [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=15d"]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def grafana_expr(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced, so Prometheus itself can run it."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, query) for every panel target of the project's Grafana dashboards."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            out += [(board["uid"], panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return out


def alert_rules() -> list[tuple[str, str]]:
    """(alert name, expression) for every rule in the project's alert rules."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r["alert"], r["expr"].strip()) for g in groups for r in g["rules"] if "alert" in r]


def metric_names(expr: str) -> set[str]:
    """The Ray-exported metric names a query reads (every one starts with `ray_`)."""
    return set(re.findall(r"\b(ray_[A-Za-z0-9_:]+)", expr))
