"""Jobs that say why they wait (core/resource_wait.py): the report's figures, and on the test stack a Ray Data
job whose CPUs a Serve app holds reports the wait within 30 s and fails at max_wait_s."""

from __future__ import annotations

import os
import signal
import time

import pytest

from core.resource_wait import Pending, ResourceWaitTimeout, ResourceWatch, WaitReport, add_up
from tests.serve.held_cpus import APP, serve_app_holding_cpus


def test_report_names_the_ask_the_free_and_the_holders():
    report = WaitReport(
        stage="batch_infer", waited_s=12.4, max_wait_s=60,
        asked=[Pending("task ReadJSON", {"CPU": 0.25, "memory": 1e9})],
        free={}, free_per_node=[0.0, 0.0], total={"CPU": 2.0},
        holders={"Serve app rayline": {"CPU": 0.5}, "this job": {"CPU": 1.0}},
        autoscaler="none reported to Ray: the cluster will not grow; what is asked must fit what is there")
    text = report.message()
    assert text.splitlines()[0] == "batch_infer: waiting 12s for resources; fails at max_wait_s=60"
    assert "asked:      {CPU: 0.25} pending: task ReadJSON {CPU: 0.25}" in text
    # Ray leaves CPU out of available_resources() once none is free: the report says 0.
    assert "free:       {CPU: 0} of {CPU: 2} (per node: 0, 0 CPU)" in text
    assert "held by:    Serve app rayline {CPU: 0.5}; this job {CPU: 1}" in text
    assert "autoscaler: none reported to Ray" in text


def test_add_up_leaves_out_bundle_and_node_markers():
    bundles = [{"CPU": 1.0, "CPU_group_0_abc": 1.0, "bundle_group_abc": 0.001, "node:127.0.0.1": 0.001},
               {"CPU": 0.5, "memory": 2e9}]
    assert add_up(bundles) == {"CPU": 1.5}


WATCH_A_CLOSED_PORT = """
import json, time
from core.resource_wait import ResourceWatch
said = []
with ResourceWatch("prepare_data", name_prefix="rayline-", address="http://127.0.0.1:9", poll_s=0.05,
                   print_fn=said.append) as watch:
    deadline = time.monotonic() + 120  # a failing call may take its client's retries and timeout first
    while watch.polls < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
print(json.dumps({"polls": watch.polls, "said": said}))
"""


def test_a_state_api_that_does_not_answer_is_said_once_and_the_block_runs_on():
    """A Ray without its dashboard (bench_data's `ray.init(include_dashboard=False)`) fails every poll the same way:
    one line, not one a poll. In a fresh interpreter: a process already joined to a Ray cluster asks that one
    whatever the address says."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", WATCH_A_CLOSED_PORT], cwd=root, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["polls"] >= 5, "the watch did not poll 5 times in 2 minutes"
    assert len(out["said"]) == 1, out["said"]
    assert out["said"][0].startswith("prepare_data: resource watch: ") and "said again only if it changes" in out["said"][0]


@pytest.fixture()
def cpus_held_by_serve_app(ray_session):
    with serve_app_holding_cpus(left=0.5) as held:
        yield held


def test_a_job_whose_cpus_a_serve_app_holds_says_so_and_fails_at_max_wait_s(cpus_held_by_serve_app, ray_session):
    """Run as a shell's background job runs (`cmd &`: SIGINT ignored, so Python handles none), where the watch must
    still stop the block at max_wait_s; the other waits here and in tests/train/test_train_wait.py run with Python's
    own SIGINT handler."""
    import ray.data

    lines: list[str] = []
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        started = time.monotonic()
        with pytest.raises(ResourceWaitTimeout) as failed:
            with ResourceWatch("test-job", max_wait_s=12, print_fn=lines.append) as watch:
                ray.data.range(4, override_num_blocks=2).map_batches(lambda b: b, num_cpus=1).materialize()
        took = time.monotonic() - started
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # as the process had it
    finally:
        signal.signal(signal.SIGINT, before)

    first = watch.reports[0]
    assert first.waited_s < 30
    assert first.asked and add_up(p.resources for p in first.asked)["CPU"] >= 1
    assert first.holders[f"Serve app {APP}"]["CPU"] == pytest.approx(cpus_held_by_serve_app)
    assert first.free.get("CPU", 0.0) <= 0.5 + 1e-6
    assert lines[0].startswith("test-job: waiting ") and f"Serve app {APP} {{CPU: {cpus_held_by_serve_app:g}}}" in lines[0]
    assert "autoscaler: none reported to Ray" in lines[0]
    # It gave up at max_wait_s (plus a poll and the state reads), with the report as the error.
    assert 12 <= took < 40
    assert str(failed.value).startswith("test-job: waiting ") and "fails at max_wait_s=12" in str(failed.value)


def test_a_serve_deploy_whose_replica_cannot_be_placed_says_so_and_fails_at_max_wait_s(cpus_held_by_serve_app,
                                                                                       ray_session):
    """What `python -m pipelines.serve` watches: the app's replicas by name (SERVE_REPLICA::<app>#...)."""
    from ray import serve

    from core.resource_wait import SERVE_REPLICA_PREFIX
    from tests.serve.echo_app import Echo

    lines: list[str] = []
    try:
        with pytest.raises(ResourceWaitTimeout) as failed:
            with ResourceWatch("serve", max_wait_s=12, name_prefix=f"{SERVE_REPLICA_PREFIX}wants-cpus#",
                               print_fn=lines.append) as watch:
                # serve.run returns once the app runs, as pipelines.serve waits for it to be healthy
                serve.run(Echo.options(ray_actor_options={"num_cpus": 1}).bind("wants", False), name="wants-cpus",
                          route_prefix="/wants-cpus")
    finally:
        serve.delete("wants-cpus")
    first = watch.reports[0]
    assert first.waited_s < 30
    assert [p.what.split()[0] for p in first.asked] == ["actor"] and first.asked[0].resources == {"CPU": 1.0}
    assert first.holders[f"Serve app {APP}"]["CPU"] == pytest.approx(cpus_held_by_serve_app)
    assert "fails at max_wait_s=12" in str(failed.value) and f"Serve app {APP}" in lines[0]
