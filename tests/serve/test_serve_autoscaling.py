"""Serve autoscaling of the engine deployment (serve/serve_config.py AutoscalingConfig): a bounded loopback load
queues requests, Serve adds a second engine replica, and once the load stops the extra replica goes after the
downscale delay. Real parts: the app deployed with `python -m pipelines.serve`, vLLM engines on CPU, the
`openai` client over HTTP, replica states read from the dashboard's Serve REST API.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import yaml

from pipelines import registry
from serve.deploy_target import LocalServe
from tests.serve.serving import register_fresh, serve_config_dict

APP, PREFIX, MODEL = "rayline-test-autoscale", "/autoscale-test", "rayline-autoscale-test"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 2.0, "downscale_delay_s": 8.0, "look_back_period_s": 4.0}
STREAMS = 8
LOAD_LIMIT_S = 240.0


class ReplicaTimeline:
    """Polls the app's replicas and records each replica's state changes as (seconds since start, id, state)."""

    def __init__(self, target: LocalServe, every_s: float = 0.5):
        self.target, self.every_s = target, every_s
        self.events: list[tuple[float, str, str]] = []
        self.running = self.replicas = 0
        self._states: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                replicas = self.target.replicas()
            except Exception:  # a slow dashboard answer: the next poll catches up
                continue
            now = {r["replica_id"]: r["state"] for r in replicas if r["deployment"].startswith("LLMServer")}
            for rid in set(now) | set(self._states):
                state = now.get(rid, "GONE")
                if self._states.get(rid) != state:
                    self.events.append((round(time.monotonic() - self.started, 1), rid[-8:], state))
            self._states = now
            self.replicas = len(now)
            self.running = sum(1 for s in now.values() if s == "RUNNING")

    def __enter__(self) -> "ReplicaTimeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.5)
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicas_follow_the_queue_from_one_to_two_and_back(local_stack, tiny_model_dir, tmp_path):
    from openai import OpenAI

    (version,) = register_fresh(MODEL, [(str(tiny_model_dir), {})])
    registry.set_alias(MODEL, "champion", version)
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump({**serve_config_dict(APP, PREFIX, MODEL), "autoscaling": AUTOSCALING}))
    target = LocalServe(APP)
    try:
        out = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(cfg_file)],
                             capture_output=True, text=True, timeout=900, cwd=registry.PROJECT_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        client = OpenAI(base_url=f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}/v1", api_key="unused",
                        max_retries=0, timeout=120)
        counts = {"ok": 0, "failed": 0}
        lock, stop = threading.Lock(), threading.Event()

        def count(outcome: str) -> None:
            with lock:
                counts[outcome] += 1

        def stream() -> None:
            while not stop.is_set():
                try:
                    r = client.chat.completions.create(
                        model="rayline", messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=48,
                        extra_body={"ignore_eos": True})
                    count("ok" if r.choices[0].message.content else "failed")
                except Exception:
                    count("failed")

        with ReplicaTimeline(target) as timeline:
            assert timeline.wait_for(lambda t: t.running == 1, 60), timeline.events
            load_started = time.monotonic() - timeline.started
            workers = [threading.Thread(target=stream, daemon=True) for _ in range(STREAMS)]
            for w in workers:
                w.start()
            try:
                scaled_up = timeline.wait_for(lambda t: t.running == 2, LOAD_LIMIT_S)
            finally:
                stop.set()
                for w in workers:
                    w.join(150)
            load_ended = time.monotonic() - timeline.started
            scaled_down = timeline.wait_for(
                lambda t: t.running == 1 and t.replicas == 1,
                AUTOSCALING["downscale_delay_s"] + 120)
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
