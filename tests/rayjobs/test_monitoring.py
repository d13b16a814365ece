"""The PodMonitor `pipelines.render --podmonitor` writes selects every Ray pod of every shipped manifest, on the
port their metrics agents listen on; its offline check names what is wrong."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayjobs import monitoring, render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "rayjobs" / "rendered").glob("*.yaml"))


@pytest.fixture(scope="module")
def profile():
    return render.load_profile(None)


def _pod_templates(doc: dict):
    spec = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    yield "head", spec["headGroupSpec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group


def test_podmonitor_selects_every_shipped_ray_pod_on_its_metrics_port(profile):
    pm = monitoring.podmonitor(profile)
    assert monitoring.check_podmonitor(pm) == []
    selector = pm["spec"]["selector"]["matchLabels"]
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    assert SHIPPED
    for path in SHIPPED:
        doc = next(yaml.safe_load_all(path.read_text()))  # the Ray object; its NetworkPolicy follows
        assert doc["metadata"]["namespace"] in pm["spec"]["namespaceSelector"]["matchNames"], path.name
        for group, spec in _pod_templates(doc):
            labels = spec["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{path.name} {group}: pods not selected"
            (container,) = spec["template"]["spec"]["containers"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert str(ports[port]) == spec["rayStartParams"]["metrics-export-port"], f"{path.name} {group}"


def test_check_names_the_wrong_field(profile):
    pm = monitoring.podmonitor(profile)
    pm["spec"]["podMetricEndpoints"] = pm["spec"].pop("podMetricsEndpoints")  # a typo kubectl would refuse
    pm["metadata"]["name"] = "Rayline_Nodes"
    problems = {(p.path, p.message) for p in monitoring.check_podmonitor(pm)}
    assert ("spec", "'podMetricsEndpoints' is a required property") in problems
    assert ("spec.podMetricEndpoints", "unknown field; did you mean 'podMetricsEndpoints'?") in problems
    assert any(path == "metadata.name" and "Rayline_Nodes" in msg for path, msg in problems), problems
    bad = monitoring.podmonitor(profile)
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    assert [p.path for p in monitoring.check_podmonitor(bad)] == ["spec.podMetricsEndpoints.0.interval"]


def test_render_cli_writes_the_podmonitor(tmp_path):
    out = tmp_path / "pm.yaml"
    run = subprocess.run([sys.executable, "-m", "pipelines.render", "--podmonitor", "--podmonitor-label",
                          "release=prometheus", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and "PodMonitor rendered and validated (not applied)" in run.stderr, run.stderr
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "PodMonitor" and doc["metadata"]["labels"]["release"] == "prometheus"
    bad = subprocess.run([sys.executable, "-m", "pipelines.render", "--podmonitor", "--podmonitor-label", "release"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
