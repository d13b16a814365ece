"""Serve autoscaling of the engine deployment (serve/serve_config.py AutoscalingConfig): a bounded loopback load
queues requests, Serve adds a second engine replica, and once the load stops the extra replica goes after the
downscale delay. Real parts: the app deployed with `python -m pipelines.serve`, vLLM engines on CPU, the
`openai` client over HTTP, replica states read from the dashboard's Serve REST API.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from pipelines import registry
from serve.deploy_target import LocalServe
from tests.serve.serving import ChatLoad, ReplicaTimeline, register_fresh, serve_config_dict

APP, PREFIX, MODEL = "rayline-test-autoscale", "/autoscale-test", "rayline-autoscale-test"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 2.0, "downscale_delay_s": 8.0, "look_back_period_s": 4.0}
STREAMS = 8
LOAD_LIMIT_S = 240.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicas_follow_the_queue_from_one_to_two_and_back(local_stack, tiny_model_dir, tmp_path):
    (version,) = register_fresh(MODEL, [(str(tiny_model_dir), {})])
    registry.set_alias(MODEL, "champion", version)
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump({**serve_config_dict(APP, PREFIX, MODEL), "autoscaling": AUTOSCALING}))
    target = LocalServe(APP)
    try:
        out = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(cfg_file)],
                             capture_output=True, text=True, timeout=900, cwd=registry.PROJECT_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        load = ChatLoad(f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}/v1", STREAMS)
        with ReplicaTimeline(target) as timeline:
            assert timeline.wait_for(lambda t: t.running == 1, 60), timeline.events
            load_started = time.monotonic() - timeline.started
            with load:
                scaled_up = timeline.wait_for(lambda t: t.running == 2, LOAD_LIMIT_S)
            load_ended = time.monotonic() - timeline.started
            scaled_down = timeline.wait_for(
                lambda t: t.running == 1 and t.replicas == 1,
                AUTOSCALING["downscale_delay_s"] + 120)
        counts = load.counts()
        print(f"load {load_started:.1f}-{load_ended:.1f} s, {counts}; replica events (s, replica, state): "
              f"{timeline.events}")
        assert scaled_up, f"no second replica under {STREAMS} streams: {timeline.events}"
        assert scaled_down, f"the second replica did not go once the load stopped: {timeline.events}"
        assert counts["failed"] == 0 and counts["ok"] > 0, counts
        # The second replica started while the load ran, and stopped only after it ended, not before the delay.
        second = [e for e in timeline.events if e[2] == "STARTING" and e[0] >= load_started]
        gone = [e for e in timeline.events if e[2] in ("STOPPING", "GONE") and e[0] >= load_ended]
        assert second and gone, timeline.events
        assert gone[0][0] - load_ended >= AUTOSCALING["downscale_delay_s"] - 1, timeline.events
    finally:
        target.delete()
