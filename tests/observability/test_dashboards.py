"""The Grafana dashboards and provisioning files: well-formed, every query valid PromQL (checked by promtool),
and every rayline metric both defined in core/metrics.py and shown somewhere. The live check, each
panel returning series after a real chain, is in tests/pipelines/test_demo.py."""

import json
import subprocess

import yaml

from core import metrics
from stack import prometheus

BOARDS = sorted(prometheus.DASHBOARDS.glob("*.json"))


def test_dashboards_are_grafana_json():
    assert {b.stem for b in BOARDS} == {"rayline-overview", "rayline-training", "rayline-batch", "rayline-serving", "rayline-grpo"}
    for path in BOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] == path.stem and board["title"].startswith("rayline: ")
        assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in board["panels"]:
            assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == "${datasource}"
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]


def test_every_query_is_valid_promql(tmp_path, promtool):
    queries = prometheus.dashboard_queries()
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"rayline:panel_{i}", "expr": prometheus.grafana_expr(expr)} for i, (_, _, expr) in enumerate(queries)]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(tmp_path / "panels.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(queries)} rules found" in out.stdout
    # ... and a broken one is caught the same way.
    rules["groups"][0]["rules"].append({"record": "rayline:broken", "expr": "sum by (model (ray_rayline_serve_requests_total)"})
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    assert subprocess.run([promtool, "check", "rules", str(tmp_path / "panels.yml")], capture_output=True).returncode != 0


def test_every_rayline_metric_is_defined_and_shown():
    shown = set()
    queries = prometheus.dashboard_queries() + [("alerts", name, expr) for name, expr in prometheus.alert_rules()]
    for uid, title, expr in queries:
        for m in prometheus.metric_names(expr):
            if m.startswith("ray_rayline_"):
                assert metrics.defined_as(m), f"{uid} / {title}: {m} is not defined in core/metrics.py"
                shown.add(metrics.defined_as(m))
    assert set(metrics.METRICS) - shown == set(), f"on no dashboard, in no alert: {sorted(set(metrics.METRICS) - shown)}"


def test_provisioning_points_at_the_dashboards():
    root = prometheus.OBSERVABILITY / "grafana" / "provisioning"
    ds = yaml.safe_load((root / "datasources" / "rayline.yaml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"].endswith(":9095")  # the stack's default prometheus_port
    provider = yaml.safe_load((root / "dashboards" / "rayline.yaml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
