"""The OpenAI app for real: Ray Serve LLM + vLLM on CPU + the MLflow server of the test stack, via `pipelines.serve`.

The app is deployed once for the module by the real entry point (`python -m pipelines.serve`) from a
tiny model registered as `models:/<name>@champion`, then driven with the `openai` client: every route
incl. streaming, the served version in `system_fingerprint` and `/v1/models`, and the bad-request suite
(OpenAI-style 4xx bodies, the service stays healthy). The app is removed at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import yaml

from pipelines import registry
from serve.app import served_model_of
from serve.deploy_target import LocalServe

# The app starts in the first test's setup, which pytest-timeout counts against that test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "rayline-serve-test"
APP = "rayline-test-serve"
PREFIX = "/serve-test"
TEST_ENGINE = {
    "accelerator": "cpu", "max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "enforce_eager": True,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "kv_cache_memory_bytes": 64 * 2**20,
    "cpus_per_engine": 0.2,
    # vLLM pins every CPU engine's compute thread to core 0 by default; on a shared 2-core box that core is
    # the busiest, and during a rolling update both engines would sit on it. One unpinned thread instead.
    "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
}


def serve_config_dict(app: str, prefix: str, model: str) -> dict:
    """The serving YAML the integration tests deploy: the tiny model, fractional CPUs for the shared 2-core head."""
    return {"app_name": app, "route_prefix": prefix, "served_model_id": "rayline",
            "engine": {"model": f"models:/{model}@champion", **TEST_ENGINE},
            "ingress_cpus": 0.05, "graceful_shutdown_timeout_s": 10}


def register_fresh(name: str, checkpoints: list[tuple[str, dict]]) -> list[str]:
    """Register `name` anew (earlier sessions' versions removed) with one version per (path, tags); returns versions."""
    c = registry.client()
    try:
        c.delete_registered_model(name)
    except Exception:
        pass
    versions = []
    with registry.start_run("rayline-tests", f"register-{name}") as run:
        for path, tags in checkpoints:
            mv = registry.register_checkpoint(name, path, run_id=run.info.run_id, tags=tags)
            versions.append(str(mv.version))
    return versions


@pytest.fixture(scope="module")
def served(local_stack, tiny_model_dir, tmp_path_factory):
    (version,) = register_fresh(MODEL, [(str(tiny_model_dir), {"eval.exact_match": "0.6"})])
    registry.set_alias(MODEL, "champion", version)
    cfg_file = tmp_path_factory.mktemp("serve-config") / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump(serve_config_dict(APP, PREFIX, MODEL)))
    target = LocalServe(APP)
    try:
        out = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(cfg_file)],
                             capture_output=True, text=True, timeout=900, cwd=registry.PROJECT_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"serving {MODEL}/{version} as 'rayline'" in out.stdout
        yield {"version": version, "label": f"{MODEL}/{version}", "target": target,
               "base_url": f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}/v1"}
    finally:
        target.delete()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served["base_url"], api_key="unused", max_retries=0, timeout=120)


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


def raw_post(base_url: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base_url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD_REQUESTS = {
    "invalid JSON": ("/completions", b'{"model": "rayline", "prompt": ', 400),
    "unknown model": ("/completions", json.dumps({"model": "gpt-9", "prompt": "hi", "max_tokens": 4}).encode(), 404),
    "max_tokens beyond the context": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hi", "max_tokens": 100_000}).encode(), 400),
    "empty messages": ("/chat/completions", json.dumps({"model": "rayline", "messages": []}).encode(), 400),
    "prompt too long": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hello " * 2000, "max_tokens": 4}).encode(), 400),
    "chat prompt too long, streamed": ("/chat/completions", json.dumps(
        {"model": "rayline", "messages": [{"role": "user", "content": "hello " * 2000}], "stream": True}).encode(), 400),
    "negative max_tokens": (
        "/completions", json.dumps({"model": "rayline", "prompt": "hi", "max_tokens": -1}).encode(), 400),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_style_errors(served, case):
    path, body, code = BAD_REQUESTS[case]
    status, reply = raw_post(served["base_url"], path, body)
    assert status == code, reply
    err = reply["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err


def test_openai_client_raises_typed_errors_and_service_stays_healthy(served, client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_model_len|context"):
        client.completions.create(model="rayline", prompt="hi", max_tokens=100_000)
    st = served["target"].state()
    assert st.status == "RUNNING", st
    r = client.completions.create(model="rayline", prompt="still there?", max_tokens=4)
    assert r.system_fingerprint == served["label"]


def test_the_deployed_app_is_the_rendered_serve_config(served):
    app = served["target"].current()
    assert app["import_path"] == "serve.app:build_app" and app["route_prefix"] == PREFIX
    pinned = served_model_of(app)
    assert (pinned.name, pinned.version, pinned.ref) == (MODEL, served["version"], f"models:/{MODEL}/{served['version']}")
    assert app["args"]["config"]["engine"]["max_model_len"] == 256
    tags = registry.client().get_model_version(MODEL, served["version"]).tags
    assert tags["rollout.status"] == "deployed" and tags["deployed_at"]
