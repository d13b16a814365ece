"""rayline's metrics (core/metrics.py) through Ray's metrics API into the stack's real Prometheus."""

import subprocess
import sys
import uuid

import pytest

from core import metrics
from stack import prometheus
from core import prometheus_query
from stack.lifecycle import env_vars


def test_exported_names_follow_rays_prefix_and_prometheus_conventions():
    assert metrics.exported("rayline_data_records_read") == "ray_rayline_data_records_read_total"
    assert metrics.exported("rayline_train_loss") == "ray_rayline_train_loss"
    assert metrics.defined_as("ray_rayline_rollout_duration_seconds_bucket") == "rayline_rollout_duration_seconds"
    assert metrics.defined_as("ray_rayline_train_loss_total") is None
    for name, m in metrics.METRICS.items():
        assert name.startswith("rayline_") and not name.endswith("_total")  # Ray adds _total to counters
        # A counter counts things; seconds only as resource time used, as Prometheus' own process_cpu_seconds_total.
        resource_time = name.endswith(("_cpu_seconds", "_gpu_seconds"))
        assert m.kind != metrics.COUNTER or resource_time or not any(u in name for u in ("_seconds", "_ratio")), name
        assert not {"request_id", "prompt", "path", "uri"} & set(m.tags), name  # no unbounded labels


def test_misuse_is_refused_with_the_metric_named():
    with pytest.raises(ValueError, match=r"rayline_train_loss: tags \['run'\] given, \['model', 'run'\] expected"):
        metrics.gauge("rayline_train_loss", 1.0, run="r")
    with pytest.raises(ValueError, match="rayline_train_loss is a gauge, not a counter"):
        metrics.inc("rayline_train_loss", 1.0, run="r", model="m")
    with pytest.raises(ValueError, match="a counter only grows"):
        metrics.inc("rayline_rollouts", -1, model="m", outcome="deployed")
    with pytest.raises(ValueError, match="rayline_rollouts is a counter, not a histogram"):
        metrics.observe("rayline_rollouts", 3.0, model="m", outcome="deployed")


def test_outside_ray_recording_is_a_no_op():
    code = ("from core import metrics; import ray\n"
            "metrics.inc('rayline_rollouts', 1, model='m', outcome='deployed')\n"
            "metrics.gauge('rayline_train_loss', 2.0, run='r', model='m')\n"
            "print('connected', ray.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "connected False", out.stderr[-2000:]


def test_a_driver_records_and_prometheus_scrapes_it(local_stack):
    url = env_vars(local_stack).get("RAYLINE_PROMETHEUS_URL")
    assert url, f"the test stack runs no Prometheus: {prometheus.available()}"
    run = uuid.uuid4().hex[:8]
    code = ("from core import metrics\nfrom core.ray_cluster import init_ray\ninit_ray()\n"
            f"metrics.inc('rayline_rollouts', 2, model='{run}', outcome='rejected')\n"
            f"metrics.gauge('rayline_train_loss', 1.25, run='{run}', model='m')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # The driver has exited: its counter stays in Prometheus, its gauge was scraped while it lived or just after.
    got = prometheus_query.wait_for(url, f'ray_rayline_rollouts_total{{model="{run}"}}', timeout_s=90)
    assert [(s["metric"]["outcome"], float(s["value"][1])) for s in got] == [("rejected", 2.0)]
    loss = prometheus_query.wait_for(url, f'max_over_time(ray_rayline_train_loss{{run="{run}"}}[5m])', timeout_s=30)
    assert float(loss[0]["value"][1]) == 1.25
