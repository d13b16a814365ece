"""The alert rules parse (`promtool check rules`), pass their unit tests (`promtool test rules`), and those unit
tests can fail: with the rules' thresholds moved out of reach, the same tests must report failures."""

import re
import shutil
import subprocess

import yaml

from core import metrics
from stack import prometheus

RULES = prometheus.RULES
RULE_TESTS = RULES.with_name("alerts_test.yml")


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def test_rules_parse(promtool):
    out = run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(prometheus.alert_rules())} rules found" in out.stdout


def test_rule_unit_tests_pass(promtool):
    out = run(promtool, "test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_rule_is_unit_tested():
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    firing = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    names = {name for name, _ in prometheus.alert_rules()}
    assert names == tested, f"rules without a unit test: {sorted(names - tested)}"
    assert names == firing, f"rules never shown firing: {sorted(names - firing)}"


def test_unit_tests_fail_when_thresholds_move(promtool, tmp_path):
    text = RULES.read_text()
    moved = re.sub(r"^(\s+)> [0-9.]+$", r"\1> 1e12", text, flags=re.M)
    moved = re.sub(r"(\)) > [0-9.]+$", r"\1 > 1e12", moved, flags=re.M)
    moved = re.sub(r"(expr: .*?) > [0-9.]+$", r"\1 > 1e12", moved, flags=re.M)
    assert moved.count("1e12") == len(prometheus.alert_rules()) - 1  # all but the NaN rule, which has no threshold
    (tmp_path / "alerts.yml").write_text(moved)
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yml")
    out = run(promtool, "test", "rules", str(tmp_path / "alerts_test.yml"))
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
    failed = set(re.findall(r"alertname: (\w+)", out.stdout + out.stderr))
    assert failed == {n for n, _ in prometheus.alert_rules()} - {"RaylineTrainLossNotFinite"}, failed


def test_rules_read_only_metrics_that_exist():
    """rayline's metrics in the rules are ones core/metrics.py defines (by their exported names)."""
    for name, expr in prometheus.alert_rules():
        for metric in prometheus.metric_names(expr):
            if metric.startswith("ray_rayline_"):
                assert metrics.defined_as(metric), f"{name}: {metric} is not one of rayline's metrics"
