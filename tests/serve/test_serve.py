"""The OpenAI app for real: Ray Serve LLM + vLLM on CPU + the MLflow server of the test stack, via `pipelines.serve`.

The app (tests/serve/conftest.py, shared with test_llm_hooks.py) is deployed once by the real entry point (`python -m pipelines.serve`) from a
tiny model registered as `models:/<name>@champion`, then driven with the `openai` client: every route
incl. streaming, the served version in `system_fingerprint` and `/v1/models`, and the bad-request suite
(OpenAI-style 4xx bodies, the service stays healthy).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from core import registry
from serve.online.app import served_model_of
from serve.promotion.verify import key_header
from tests.serve.serving import SERVED_MODEL, SERVED_PREFIX, http_json, serving_keys

# The app starts in the first test's setup, which pytest-timeout counts against that test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL, PREFIX = SERVED_MODEL, SERVED_PREFIX


def test_models_route_lists_the_served_version(served, client):
    (card,) = client.models.list().data
    assert card.id == "rayline"
    meta = card.model_extra["metadata"]["rayline"]
    assert (meta["name"], meta["version"], meta["alias"], meta["label"]) == (MODEL, served["version"], "champion", served["label"])
    assert client.models.retrieve("rayline").id == "rayline"


def test_completions_and_chat_name_the_version_that_answered(served, client):
    r = client.completions.create(model="rayline", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert r.system_fingerprint == served["label"] and r.choices[0].text and r.usage.completion_tokens > 0
    r = client.chat.completions.create(model="rayline", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert r.system_fingerprint == served["label"] and r.choices[0].message.role == "assistant"


def test_streaming_completions_and_chat(served, client):
    chunks = list(client.completions.create(model="rayline", prompt="hello", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks if c.choices)
    chunks = list(client.chat.completions.create(model="rayline", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=12, stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) > 1 and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The terminal chunk carries the version too.
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].system_fingerprint == served["label"]


# case -> (route, body, status, error type, what the message must name). vLLM's error body is OpenAI's shape,
# {"error": {"message", "type", "param", "code"}}, with its own type names and the status as `code`.
BAD_REQUESTS = {
    # A body FastAPI cannot parse gets vLLM's validation handler: the status phrase as type, pydantic's error.
    "invalid JSON": ("/completions", b'{"model": "rayline", "prompt": ', 400, "Bad Request", r"json_invalid.*JSON decode error"),
    "unknown model": ("/completions", json.dumps({"model": "gpt-9", "prompt": "hi", "max_tokens": 4}).encode(), 404,
                      "NotFoundError", r"gpt-9"),
    # Within the server's cap (auth.max_tokens, 4096: above it the API key gate answers, test_api_keys.py).
    "max_tokens beyond the context": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hi", "max_tokens": 4000}).encode(), 400,
        "BadRequestError", r"4000.*256|256.*4000"),
    "empty messages": ("/chat/completions", json.dumps({"model": "rayline", "messages": []}).encode(), 400,
                       "BadRequestError", r"empty conversation\. Provide at least one message"),
    "prompt too long": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hello " * 2000, "max_tokens": 4}).encode(), 400,
        "BadRequestError", r"256"),
    "chat prompt too long, streamed": ("/chat/completions", json.dumps(
        {"model": "rayline", "messages": [{"role": "user", "content": "hello " * 2000}], "stream": True}).encode(), 400,
        "BadRequestError", r"256"),
    "negative max_tokens": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hi", "max_tokens": -1}).encode(), 400,
        "BadRequestError", r"max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_style_errors(served, case):
    path, body, code, err_type, names = BAD_REQUESTS[case]
    status, reply = http_json(served["base_url"] + path, body)
    assert status == code, reply
    assert set(reply) == {"error"} and set(reply["error"]) >= {"message", "type", "param", "code"}, reply
    err = reply["error"]
    assert (err["code"], err["type"]) == (code, err_type), reply
    assert re.search(names, err["message"]), reply


def test_openai_client_raises_typed_errors_and_service_stays_healthy(served, client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_model_len|context"):
        client.completions.create(model="rayline", prompt="hi", max_tokens=4000)  # within auth.max_tokens
    st = served["target"].state()
    assert st.status == "RUNNING", st
    r = client.completions.create(model="rayline", prompt="still there?", max_tokens=4)
    assert r.system_fingerprint == served["label"]


def test_the_deployed_app_is_the_rendered_serve_config(served):
    app = served["target"].current()
    assert app["import_path"] == "serve.online.app:build_app" and app["route_prefix"] == PREFIX
    pinned = served_model_of(app)
    assert (pinned.name, pinned.version, pinned.ref) == (MODEL, served["version"], f"models:/{MODEL}/{served['version']}")
    assert app["args"]["config"]["engine"]["max_model_len"] == 256
    tags = registry.client().get_model_version(MODEL, served["version"]).tags
    assert tags["rollout.status"] == "deployed" and tags["deployed_at"]


def test_responses_are_counted_by_version_and_status_in_prometheus(served, client, local_stack):
    """The replica's own counts, through Ray's metrics agent and the stack's real Prometheus; and its served-version
    gauge, set once when the replica started, still exported well after Ray alone would have dropped it (~20-25 s
    after a gauge was last set): rayline's gauges are re-set while their process lives (core/metrics.py)."""
    import time

    from core import prometheus_query
    from stack.lifecycle import env_vars
    from tests.serve.serving import SERVED_APP

    url = env_vars(local_stack)["RAYLINE_PROMETHEUS_URL"]
    labels = f'app="{SERVED_APP}", model="{MODEL}", version="{served["version"]}"'

    def counts() -> dict[str, float]:
        got = prometheus_query.query(url, f"sum by (code) (ray_rayline_serve_requests_total{{{labels}}})")
        return {s["metric"]["code"]: float(s["value"][1]) for s in got}

    # In the suite the app has long been up by now; run alone, this waits. Prometheus drops a series from instant
    # queries at the first scrape that no longer has it, so this reads what the agent exports now.
    time.sleep(max(0.0, served["ready_at"] + 35 - time.time()))
    assert prometheus_query.wait_for(url, f"ray_rayline_served_version{{{labels}}} == 1", timeout_s=60)
    # Earlier tests' responses may still be on their way (export ~5 s, scrape every 5 s), so the exact count is
    # taken on a status no other test causes (405: GET on a POST route); 200s are checked to rise by this test's.
    ok_before = counts().get("200", 0)
    for _ in range(3):
        client.completions.create(model="rayline", prompt="hi", max_tokens=2)
    for _ in range(2):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{served['base_url']}/completions",
                                                          headers=key_header(serving_keys().client)), timeout=60)
        assert err.value.code == 405
    deadline = time.time() + 60
    while (c := counts()).get("405", 0) < 2 or c.get("200", 0) < ok_before + 3:
        if time.time() > deadline:
            break
        time.sleep(2)
    time.sleep(2 * 5)  # two more scrapes: a count past 2 would show by now
    got = counts()
    assert got.get("405", 0) == 2 and got.get("200", 0) >= ok_before + 3, (ok_before, got)
