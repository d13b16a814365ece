"""The MLflow webhook receiver and the watch loop it wakes.

The receiver's filtering and signature checks are played with MLflow's payload and signature (and calls MLflow
would never make: unsigned, forged, replayed, oversized); the watch loop is woken by the test stack's MLflow server
itself, signing with the stack's webhook secret, driving a real rollout.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid

import mlflow
import pytest
import yaml

from core import registry
from core.config import ConfigError, from_dict
from serve.promotion import rollout_record as rec
from serve.promotion.deploy_target import LocalServe
from serve.promotion.outcome import REJECTED
from serve.promotion.rollout import Rollout
from serve.promotion.rollout_config import Config as RolloutConfig
from serve.promotion.webhook import (DELIVERY_HEADER, MAX_BODY_BYTES, SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookReceiver, sign,
                           signature_problem)
from tests.serve.mlflow_ui import add_alias_in_ui, browser_missing
from tests.serve.serving import free_port, register_fresh, serve_config_dict

SECRET = "s3cret"
MODEL, APP = "rayline-webhook-test", "rayline-test-webhook"
POLL_S = 60


def mlflow_delivery(url: str, payload: dict, secret: str | None = SECRET, delivery: str = "", ts: int | None = None,
                    body: str | None = None):
    """POST the way MLflow's webhook delivery does (mlflow/webhooks/delivery.py): a new delivery id each time unless
    `delivery` is given."""
    body = json.dumps(payload) if body is None else body
    delivery = delivery or str(uuid.uuid4())
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
    assert "no webhook secret" in signature_problem("", headers, "{}", now=130)  # nothing is authentic without one


@pytest.fixture()
def receiver():
    calls = []
    r = WebhookReceiver("rayline-tiny", "champion", lambda data, d: calls.append((data, d)), port=free_port(),
                        secret=SECRET).start()
    r.calls = calls
    yield r
    r.stop()


def test_only_our_alias_creation_wakes_the_rollout(receiver):
    assert mlflow_delivery(receiver.url, alias_event(), delivery="d-1") == (200, {"accepted": True})
    assert receiver.calls == [({"name": "rayline-tiny", "alias": "champion", "version": "4"}, "d-1")]
    assert mlflow_delivery(receiver.url, alias_event(alias="staging"))[1]["accepted"] is False
    assert mlflow_delivery(receiver.url, alias_event(name="other"))[1]["accepted"] is False
    assert mlflow_delivery(receiver.url, alias_event(action="deleted"))[1]["accepted"] is False
    assert len(receiver.calls) == 1


def test_a_canary_watch_wakes_for_champion_and_challenger_only():
    calls = []
    r = WebhookReceiver("rayline-tiny", ("champion", "challenger"), lambda data, d: calls.append(data["alias"]),
                        port=free_port(), secret=SECRET).start()
    try:
        for alias in ("challenger", "staging", "champion"):
            mlflow_delivery(r.url, alias_event(alias=alias))
        assert mlflow_delivery(r.url, alias_event(alias="staging"))[1] == {
            "accepted": False, "reason": "not rayline-tiny@champion|challenger"}
    finally:
        r.stop()
    assert calls == ["challenger", "champion"]


def test_unsigned_or_forged_calls_are_refused(receiver):
    code, body = mlflow_delivery(receiver.url, alias_event(), secret=None)
    assert code == 401 and "missing" in body["error"]
    code, body = mlflow_delivery(receiver.url, alias_event(), secret="forged")
    assert code == 401 and "signature" in body["error"]
    code, body = mlflow_delivery(receiver.url, alias_event(), ts=int(time.time()) - 301)
    assert code == 401 and "replayed" in body["error"]
    code, _ = mlflow_delivery(receiver.url.replace("/mlflow-webhook", "/other"), alias_event())
    assert code == 404
    assert receiver.calls == []


def test_a_delivery_is_accepted_once(receiver):
    """A signed delivery sent again while its timestamp is still within the window (so its signature and timestamp
    pass) is refused: MLflow gives each delivery an id of its own."""
    ts = int(time.time())
    assert mlflow_delivery(receiver.url, alias_event(), delivery="d-7", ts=ts) == (200, {"accepted": True})
    code, body = mlflow_delivery(receiver.url, alias_event(), delivery="d-7", ts=ts)
    assert code == 409 and "d-7 was already accepted" in body["error"]
    # A forged copy does not get as far as the replay check, and does not use the id up either.
    assert mlflow_delivery(receiver.url, alias_event(), secret="forged", delivery="d-8")[0] == 401
    assert mlflow_delivery(receiver.url, alias_event(), delivery="d-8") == (200, {"accepted": True})
    assert [d for _, d in receiver.calls] == ["d-7", "d-8"]


def test_an_oversized_body_is_refused_before_it_is_read(receiver):
    padded = json.dumps({**alias_event(), "pad": "x" * MAX_BODY_BYTES})
    code, body = mlflow_delivery(receiver.url, {}, body=padded)  # signed: the size alone refuses it
    assert code == 413 and f"at most {MAX_BODY_BYTES}" in body["error"]
    # A client that announces 1 GB gets the answer without sending any of it.
    host, port = receiver.url.split("/")[2].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"POST /mlflow-webhook HTTP/1.1\r\nHost: {host}\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
        assert s.recv(200).startswith(b"HTTP/1.0 413 ")
    assert receiver.calls == []


def test_without_a_secret_the_receiver_does_not_start(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs the secret MLflow signs its deliveries with"):
        WebhookReceiver("rayline-tiny", "champion", lambda data, d: None, port=free_port(), secret="")
    monkeypatch.delenv("RAYLINE_WEBHOOK_SECRET_FILE", raising=False)
    cfg = from_dict(RolloutConfig, {"model": "m", "watch": True, "webhook_port": 8765})
    with pytest.raises(ConfigError, match="webhook_secret_file: webhook_port=8765 needs the secret"):
        cfg.webhook_secret()
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"webhook_secret_file: cannot read {missing}"):
        from_dict(RolloutConfig, {"model": "m", "webhook_port": 8765, "webhook_secret_file": str(missing)}).webhook_secret()
    (tmp_path / "secret").write_text(f"{SECRET}\n")
    monkeypatch.setenv("RAYLINE_WEBHOOK_SECRET_FILE", str(tmp_path / "secret"))
    assert cfg.webhook_secret() == SECRET


@pytest.mark.slow  # the test stack's MLflow server and Ray dashboard, no engine
@pytest.mark.parametrize("set_in", ["client", "browser"])
def test_an_alias_set_in_mlflow_wakes_the_watching_rollout_at_once(set_in, local_stack, tiny_model_dir, tmp_path,
                                                                   caplog):
    """`pipelines.rollout --watch` as a user runs it: the rollout registers its webhook in MLflow, MLflow calls it
    (signed) when the alias is set, and the rollout runs at once, not at the next poll. The alias is set with
    MLflow's client, or in the MLflow UI with its own controls in a real browser (tests/serve/mlflow_ui.py). The
    version is below the eval gate, so the real rollout refuses it before any engine would start."""
    if set_in == "browser" and browser_missing():
        pytest.skip(f"the MLflow UI test needs a browser: {browser_missing()}")
    # The secret is the stack's (RAYLINE_WEBHOOK_SECRET_FILE, from `stack env`): the rollout gives it to MLflow.
    (version,) = register_fresh(MODEL, [(str(tiny_model_dir), {"eval.exact_match": "0.1"})])
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump(serve_config_dict(APP, "/webhook-test", MODEL)))
    cfg = from_dict(RolloutConfig, {
        "model": MODEL, "serve_config": str(serve_yaml), "gate": {"min_metrics": {"eval.exact_match": 0.5}},
        "watch": True, "poll_interval_s": POLL_S, "max_rollouts": 1, "webhook_port": free_port(), "register_webhook": True})
    rollout = Rollout(cfg)  # the local target: the test stack's dashboard (RAY_ADDRESS)
    caplog.set_level(logging.INFO, logger="rayline.rollout")
    done: list = []
    thread = threading.Thread(target=lambda: done.append(rollout.watch()), daemon=True)
    thread.start()
    try:
        # Its first look finds no alias yet (skipped, not an attempt); then it waits for the poll or a webhook call.
        wait_until(lambda: any(r.getMessage().startswith(f"rollout skipped: {MODEL}") for r in caplog.records))
        (hook,) = [h for h in registry.client().list_webhooks() if h.name == f"rayline-rollout-{MODEL}"]
        assert hook.url == f"http://127.0.0.1:{cfg.webhook_port}/mlflow-webhook" and hook.events[0].action.value == "created"
        set_at = time.time()
        if set_in == "browser":
            add_alias_in_ui(mlflow.get_tracking_uri(), MODEL, version, "champion", tmp_path)
        else:
            registry.set_alias(MODEL, "champion", version)
        thread.join(timeout=POLL_S + 30)
        woke_after = time.time() - set_at
    finally:
        for h in registry.client().list_webhooks():
            if h.name == f"rayline-rollout-{MODEL}":
                registry.client().delete_webhook(h.webhook_id)
    ((result,),) = done
    assert woke_after < POLL_S / 2, (f"{woke_after:.1f}s: the poll, not MLflow's webhook call, ran the rollout (an MLflow "
                                     "server started without stack/lifecycle.py's MLFLOW_WEBHOOK_ENV does not call loopback)")
    assert result.status == REJECTED and result.version == version, result.line()
    assert "eval.exact_match=0.1 < 0.5" in result.reason and "no earlier version" in result.reason
    tags = registry.client().get_model_version(MODEL, version).tags
    trigger = tags[rec.TAG_TRIGGERED_BY]
    assert re.fullmatch(rf"webhook:[0-9a-f-]{{36}} \({MODEL}@champion -> {version}\)", trigger), trigger  # MLflow's delivery id
    assert tags[rec.TAG_STATUS] == "rejected" and registry.client().get_run(result.run_id).data.tags[rec.TAG_TRIGGERED_BY] == trigger
    assert LocalServe(APP).current() is None  # refused before anything was deployed


def wait_until(cond, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
