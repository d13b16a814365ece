"""A canary step's figures from Prometheus series (serve/promotion/canary_metrics.py): counters grown over the window across
every replica's series, and TTFT quantiles as Prometheus's own `histogram_quantile` computes them (checked with
`promtool test rules`, Prometheus's engine, on the same buckets)."""

from __future__ import annotations

import math
import subprocess

import pytest
import yaml

from serve.promotion.canary_metrics import histogram_quantile, increase


def test_increase_counts_new_and_restarted_series_from_zero():
    a, b, c, d = (frozenset({"role": "champion", "WorkerId": w}.items()) for w in "abcd")
    before = {a: (100.0, 5.0), b: (100.0, 40.0), c: (100.0, 7.0)}
    after = {a: (110.0, 12.0), b: (110.0, 3.0), c: (110.0, 7.0), d: (110.0, 4.0)}
    # a grew by 7; b's process restarted (counter reset: its 3 are new); c idle; d started in the window
    assert increase(before, after) == {a: 7.0, b: 3.0, c: 0.0, d: 4.0}


BUCKETS = {0.01: 0.0, 0.02: 3.0, 0.05: 10.0, 0.1: 18.0, 0.5: 19.0, 1.0: 20.0, math.inf: 20.0}


def test_quantiles_are_those_prometheus_computes_from_the_same_buckets(tmp_path, promtool):
    cases = [(q, histogram_quantile(q, BUCKETS)) for q in (0.1, 0.5, 0.9, 0.99)]
    assert cases[1][1] == pytest.approx(0.05 + 0.05 * (10 - 10) / 8)  # rank 10 ends the 0.05 bucket
    series = [{"series": f'ttft_bucket{{le="{"+Inf" if math.isinf(le) else le}"}}', "values": f"{n:g}"}
              for le, n in BUCKETS.items()]
    tests = [{"expr": f"histogram_quantile({q}, ttft_bucket)", "eval_time": "0m",
              "exp_samples": [{"labels": "{}", "value": v}]} for q, v in cases]
    (tmp_path / "rules.yml").write_text("groups: []\n")
    (tmp_path / "test.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m",
                                                       "tests": [{"interval": "1m", "input_series": series,
                                                                  "promql_expr_test": tests}]}))
    out = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_quantiles_at_the_edges():
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    # every observation above the largest finite bound: that bound, as Prometheus answers
    assert histogram_quantile(0.5, {0.1: 0.0, 1.0: 0.0, math.inf: 4.0}) == 1.0
    # all in the first bucket: interpolated from 0
    assert histogram_quantile(0.5, {0.1: 4.0, math.inf: 4.0}) == pytest.approx(0.05)
