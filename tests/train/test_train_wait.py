"""A train run whose CPUs a Serve app holds says why it waits, within 30 s, and fails at scaling.max_wait_s
(core/resource_wait.py through train/trainer.py), instead of waiting silently."""

from __future__ import annotations

import re
import time

import pytest

from tests.serve.held_cpus import APP, serve_app_holding_cpus


def test_a_train_run_whose_cpus_a_serve_app_holds_says_why_and_fails_at_max_wait_s(make_train_config, start_stage,
                                                                                    ray_session):
    cfg = make_train_config("scaling.max_wait_s=12")
    with serve_app_holding_cpus(left=0.5) as held:
        started = time.monotonic()
        run = start_stage("train", cfg).finish(timeout=300)
        took = time.monotonic() - started

    assert run.returncode == 1, run
    out = run.stdout + run.stderr
    waits = [int(s) for s in re.findall(r"^train: waiting (\d+)s for resources", out, re.M)]
    assert waits and waits[0] < 30, run
    report = out[out.index("train: waiting "):]
    # What waits first is the eval split's read (Ray Data's Parquet tasks at 1 CPU each), before any worker.
    asked = re.search(r"asked: +\{CPU: ([\d.]+)\} pending: (.*)", report)
    assert asked and float(asked.group(1)) >= 1 and "task " in asked.group(2), report
    assert f"held by:    Serve app {APP} {{CPU: {held:g}}}" in report, report
    # What is free is what the holders leave (other test apps of the session may hold some too).
    free = float(re.search(r"free: +\{CPU: ([\d.]+)\} of \{CPU: 2\}", report).group(1))
    holders = re.search(r"held by: +(.*)", report).group(1)
    held_all = sum(float(x) for x in re.findall(r"\{CPU: ([\d.]+)\}", holders))
    assert free <= 0.5 + 1e-6 and free == pytest.approx(2 - held_all, abs=1e-6), report
    assert "autoscaler: none reported to Ray" in report, report
    assert "train failed: train: waiting " in run.stderr and "fails at max_wait_s=12" in run.stderr, run
    assert took < 150, run
