"""The MLflow webhook receiver and the watch loop it wakes, played against MLflow's own payload and signature."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from pipelines.config import from_dict
from serve.rollout import DEPLOYED, Rollout, RolloutResult
from serve.rollout_config import Config as RolloutConfig
from serve.serve_config import Config as ServeConfig
from serve.webhook import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookReceiver, sign, signature_problem

SECRET = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_delivery(url: str, payload: dict, secret: str | None = SECRET, delivery: str = "d-1", ts: int | None = None):
    """POST the way MLflow's webhook delivery does (mlflow/webhooks/delivery.py)."""
    body = json.dumps(payload)
    ts = str(ts or int(time.time()))
    headers = {"Content-Type": "application/json", DELIVERY_HEADER: delivery, TIMESTAMP_HEADER: ts}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, delivery, ts, body)
    req = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def alias_event(name="rayline-tiny", alias="champion", version="4", entity="model_version_alias", action="created"):
    return {"entity": entity, "action": action, "timestamp": "2026-01-01T00:00:00+00:00",
            "data": {"name": name, "alias": alias, "version": version}}


def test_signature_matches_mlflows_own_implementation():
    from mlflow.webhooks.delivery import _generate_hmac_signature

    assert sign(SECRET, "id", "123", "{}") == _generate_hmac_signature(SECRET, "id", "123", "{}")
    headers = {DELIVERY_HEADER: "id", TIMESTAMP_HEADER: "123", SIGNATURE_HEADER: sign(SECRET, "id", "123", "{}")}
    assert signature_problem(SECRET, headers, "{}", now=130) is None
    assert "replayed" in signature_problem(SECRET, headers, "{}", now=123 + 3600)
    assert "does not match" in signature_problem("other", headers, "{}", now=130)
    assert signature_problem(None, {}, "{}") is None


@pytest.fixture()
def receiver():
    calls = []
    r = WebhookReceiver("rayline-tiny", "champion", lambda data, d: calls.append((data, d)), port=free_port(),
                        secret=SECRET).start()
    r.calls = calls
    yield r
    r.stop()


def test_only_our_alias_creation_wakes_the_rollout(receiver):
    assert mlflow_delivery(receiver.url, alias_event()) == (200, {"accepted": True})
    assert receiver.calls == [({"name": "rayline-tiny", "alias": "champion", "version": "4"}, "d-1")]
    assert mlflow_delivery(receiver.url, alias_event(alias="staging"))[1]["accepted"] is False
    assert mlflow_delivery(receiver.url, alias_event(name="other"))[1]["accepted"] is False
    assert mlflow_delivery(receiver.url, alias_event(action="deleted"))[1]["accepted"] is False
    assert len(receiver.calls) == 1


def test_unsigned_or_forged_calls_are_refused(receiver):
    code, body = mlflow_delivery(receiver.url, alias_event(), secret=None)
    assert code == 401 and "missing" in body["error"]
    code, body = mlflow_delivery(receiver.url, alias_event(), secret="forged")
    assert code == 401 and "signature" in body["error"]
    code, _ = mlflow_delivery(receiver.url.replace("/mlflow-webhook", "/other"), alias_event())
    assert code == 404
    assert receiver.calls == []


class RecordingRollout(Rollout):
    """The watch loop's wiring with the rollout itself replaced: records what triggered each attempt."""

    def __init__(self, cfg):
        serve_cfg = from_dict(ServeConfig, {"engine": {"model": "models:/rayline-tiny@champion"}})
        super().__init__(cfg, serve_cfg, target=object())
        self.triggers: list[str] = []

    def once(self, triggered_by=None):
        self.triggers.append(triggered_by)
        return RolloutResult(DEPLOYED, self.name, version=str(len(self.triggers)))


def test_watch_reacts_to_a_webhook_call_without_waiting_for_the_poll(monkeypatch):
    monkeypatch.setenv("RAYLINE_WEBHOOK_SECRET", SECRET)
    port = free_port()
    cfg = RolloutConfig(poll_interval_s=600, max_rollouts=2, webhook_port=port)
    rollout = RecordingRollout(cfg)
    done: list = []
    thread = threading.Thread(target=lambda: done.append(rollout.watch()), daemon=True)
    start = time.time()
    thread.start()
    while len(rollout.triggers) < 1:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/mlflow-webhook"
    deadline = time.time() + 10
    while time.time() < deadline:  # the receiver may still be binding
        try:
            assert mlflow_delivery(url, alias_event(version="9"), delivery="abc")[1]["accepted"]
            break
        except urllib.error.URLError:
            time.sleep(0.1)
    thread.join(timeout=30)
    assert time.time() - start < 30  # not the 600 s poll interval
    assert rollout.triggers[0] == "watch:start"
    assert rollout.triggers[1].startswith("webhook:abc") and "-> 9" in rollout.triggers[1]
    assert [r.status for r in done[0]] == [DEPLOYED, DEPLOYED]
