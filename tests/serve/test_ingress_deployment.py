"""`ingress: deployment` for real: Ray's OpenAI ingress deployment (`RaylineIngress`) in front of the engine replica,
deployed with `python -m pipelines.serve` on the test stack. The ingress names the served version in its model cards,
answers unknown models OpenAI's way, and its replicas run the canary split (serve/online/canary_split.py) that a canary
rollout sets in their `user_config` (serve/online/app.py `routes_deployment_name`). The challenger here is the session's
engine-layout app (tests/serve/conftest.py `served`), another version of another registered model, so each answer's
`system_fingerprint` says which side gave it. The engine replicas behind the ingress serve LoRA adapters as in the
engine layout (RaylineServer's adapter set): the ingress routes `rayline:<name>` to them, lists each with its
version, and a promotion swaps one in place. The app routes with Ray Serve LLM's prefix-cache-affinity router
(`routing.policy: prefix_cache_affinity`), which every other test here then runs through.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from core import registry
from core.config import from_dict
from serve.online.app import INGRESS_DEPLOYMENT, engine_deployment_name, routes_deployment_name
from serve.online.canary_split import ROUTE_HEADER, STATS_PATH
from serve.promotion.deploy_target import LocalServe
from serve.online.routing_config import PREFIX_ROUTER
from serve.online.serve_config import Config as ServeConfig
from tests.serve.lora_adapters import register_base_with_adapters
from serve.promotion.verify import key_header
from tests.serve.serving import SERVED_PREFIX, deploy, http_json, openai_client, serve_config_dict, serving_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

APP, PREFIX, MODEL = "rayline-test-ingress", "/ingress-test", "rayline-ingress-test"
ADAPTERS = "rayline-ingress-adapter-test"


def post_chat(base_url: str, user: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """One chat request; (its system_fingerprint, the side the canary header names, or "" without one). With the
    canary's force header it is sent with the admin key (the only key allowed to send it), else the client key."""
    body = {"model": "rayline", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "user": user}
    key = serving_keys().admin if ROUTE_HEADER in (headers or {}) else serving_keys().client
    req = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **key_header(key), **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["system_fingerprint"], r.headers.get(ROUTE_HEADER, "")


@pytest.fixture(scope="module")
def ingress_app(local_stack, tiny_model_dir, tmp_path_factory):
    """The app with its base and two adapters: `a` (adapter version 1, `champion`) and `b` (version 2); version 3
    (another `a`) is waiting."""
    version, lora = register_base_with_adapters(MODEL, ADAPTERS, tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    cfg = {**serve_config_dict(APP, PREFIX, MODEL), "ingress": "deployment", "lora": lora,
           "routing": {"policy": "prefix_cache_affinity", "imbalanced_threshold": 4}}
    target = LocalServe(APP)
    try:
        deploy(cfg)
        root = f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}"
        yield {"cfg": from_dict(ServeConfig, cfg, "test"), "target": target, "root": root, "base_url": f"{root}/v1",
               "version": version, "label": f"{MODEL}/{version}"}
    finally:
        target.delete()


def test_the_ingress_names_the_served_version_and_answers_unknown_models_with_a_404(ingress_app):
    deployments = {r["deployment"] for r in ingress_app["target"].replicas()}
    assert deployments == {INGRESS_DEPLOYMENT, engine_deployment_name(ingress_app["cfg"])}, deployments
    assert routes_deployment_name(ingress_app["cfg"]) == INGRESS_DEPLOYMENT
    status, body = http_json(ingress_app["base_url"] + "/models")
    assert status == 200, body
    card = next(c for c in body["data"] if c["id"] == "rayline")
    stamp = card["metadata"]["rayline"]
    assert card["id"] == "rayline" and (stamp["name"], stamp["version"], stamp["label"]) == (
        MODEL, ingress_app["version"], ingress_app["label"]), card
    assert post_chat(ingress_app["base_url"], "u1") == (ingress_app["label"], "")  # no canary: no side named
    # Unknown models: Ray's ingress answers {"error": {...}} with its exception's class as the type; for a completion
    # RaylineIngress names the models there are.
    status, body = http_json(ingress_app["base_url"] + "/models/gpt-9")
    assert status == 404 and body["error"]["code"] == 404 and "Unable to find gpt-9" in body["error"]["message"], body
    status, body = http_json(ingress_app["base_url"] + "/chat/completions",
                             {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 404 and set(body) == {"error"} and body["error"]["code"] == 404, body
    assert "gpt-9" in body["error"]["message"] and "Available models: rayline." in body["error"]["message"], body


def canary(ingress_app: dict, challenger_prefix: str, mode: str):
    """The rollout's canary on this app (serve/promotion/canary.py), its challenger at `challenger_prefix`; `_split(share)`
    sets the split on the deployment that serves the routes and returns once the replicas report it."""
    from serve.promotion.canary import Canary
    from serve.promotion.rollout import Rollout
    from serve.promotion.rollout_config import Config as RolloutConfig

    cfg = from_dict(RolloutConfig, {"model": MODEL, "canary": {"steps": [1.0], "mode": mode, "metrics": "replicas",
                                                               "route_prefix": challenger_prefix}})
    return Canary(Rollout(cfg, serve_cfg=ingress_app["cfg"], target=ingress_app["target"]))


def test_the_prefix_router_reaches_the_running_engine_deployment_and_routes(ingress_app):
    # What Serve's controller runs the engine deployment with, read back from the running app.
    details = ingress_app["target"]._details()["applications"][APP]["deployments"]
    router = details[engine_deployment_name(ingress_app["cfg"])]["deployment_config"]["request_router_config"]
    assert router["request_router_class"] == PREFIX_ROUTER, router
    assert router["request_router_kwargs"] == {"imbalanced_threshold": 4.0, "match_rate_threshold": 0.1}, router
    # The router routed: its prefix tree (an actor per app and deployment) exists once requests went through it.
    assert post_chat(ingress_app["base_url"], "u-prefix")[0] == ingress_app["label"]
    status, body = http_json_dashboard(ingress_app["target"], "/api/v0/actors?filter_keys=class_name"
                                       "&filter_predicates=%3D&filter_values=PrefixTreeActor&detail=false")
    alive = [a for a in body["data"]["result"]["result"] if a["state"] == "ALIVE"]
    assert status == 200 and alive, body


def http_json_dashboard(target: LocalServe, path: str) -> tuple[int, dict]:
    """A GET on the Ray dashboard the Serve target talks to, with its token."""
    req = urllib.request.Request(target.url + path, headers={"Authorization": f"Bearer {target.token}"}
                                 if target.token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())


def test_the_ingress_replicas_split_and_shadow_to_the_challenger(ingress_app, served):
    own, other = ingress_app["label"], served["label"]
    split, shadow = canary(ingress_app, SERVED_PREFIX, "split"), canary(ingress_app, SERVED_PREFIX, "shadow")
    assert split.deployment == INGRESS_DEPLOYMENT
    try:
        split._split(1.0)
        answers = [post_chat(ingress_app["base_url"], f"user-{i}") for i in range(4)]
        assert answers == [(other, "challenger")] * 4, answers
        # The rollout's quality probe forces a side with the header, whatever the share.
        assert post_chat(ingress_app["base_url"], "probe", {ROUTE_HEADER: "champion"}) == (own, "champion")

        split._split(None)
        since = time.time()
        shadow._split(1.0)
        shadowed = [post_chat(ingress_app["base_url"], f"user-{i}") for i in range(3)]
        assert [fp for fp, _ in shadowed] == [own] * 3, shadowed  # a client never gets the challenger's answer
        deadline = time.time() + 60
        # Both sides are counted once their answer is done: the copies when the challenger answered them, and the
        # champion's in the ingress after its last chunk went out, which can come after the client read it.
        stats = f"{ingress_app['root']}{STATS_PATH}?since={since}"  # rayline's own route: the admin key's
        while ((sides := http_json(stats, api_key=serving_keys().admin)[1]["sides"])["challenger"][
                "shadow"] < 3 or sides["champion"]["requests"] < 3) and time.time() < deadline:
            time.sleep(0.5)
        assert sides["challenger"]["shadow"] == 3 and sides["challenger"]["errors"] == 0, sides
        assert sides["champion"]["requests"] == 3, sides
    finally:
        split._split(None)
    assert post_chat(ingress_app["base_url"], "after") == (own, "")


def test_the_ingress_routes_each_adapter_and_lists_it_with_its_version(ingress_app):
    """The engine replicas (RaylineServer) serve the adapters; the ingress routes `rayline:<name>` to them as it
    routes the base, lists each adapter with its version, and an unknown adapter gets a 404."""
    client = openai_client(ingress_app["base_url"])
    prompts = ["What is 3 + 4?", "Is 9 even or odd?", "Name a fruit.", "What is 12 - 5?"]
    answers = {}
    for model, answered_by in (("rayline", "rayline"), ("rayline:a", f"rayline:a@{ADAPTERS}/1"),
                               ("rayline:b", f"rayline:b@{ADAPTERS}/2")):
        replies = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                  max_tokens=8, temperature=0) for p in prompts]
        assert {r.model for r in replies} == {answered_by}, [r.model for r in replies]
        answers[model] = [r.choices[0].message.content for r in replies]
    for one, other in (("rayline", "rayline:a"), ("rayline", "rayline:b"), ("rayline:a", "rayline:b")):
        assert sum(x != y for x, y in zip(answers[one], answers[other])) >= 2, (one, other, answers)

    cards = {m.id: m.model_extra["metadata"]["rayline"] for m in client.models.list().data}
    assert set(cards) == {"rayline", "rayline:a", "rayline:b"}, cards
    assert (cards["rayline:a"]["label"], cards["rayline:a"]["adapter"]) == (f"{ADAPTERS}/1", True)
    assert cards["rayline"]["label"] == ingress_app["label"]
    one = client.models.retrieve("rayline:b")
    assert one.id == "rayline:b" and one.model_extra["metadata"]["rayline"]["label"] == f"{ADAPTERS}/2"
    status, body = http_json(ingress_app["base_url"] + "/chat/completions", {
        "model": "rayline:nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 404 and "rayline:nope" in body["error"]["message"], body


def test_an_adapter_promoted_behind_the_ingress_swaps_in_place(ingress_app):
    """`champion` on adapter version 3: the rollout sets the new set in the engine deployment's user_config and
    verifies through the ingress; the engine replica stays, and `rayline:a` answers with version 3."""
    from serve.promotion.outcome import DEPLOYED
    from serve.promotion.rollout import Rollout
    from serve.promotion.rollout_config import Config as RolloutConfig

    target = ingress_app["target"]
    replicas = {r["replica_id"] for r in target.replicas() if r["state"] == "RUNNING"}
    rollout = Rollout(from_dict(RolloutConfig, {"adapter": "a", "alias": "champion", "gate": {"min_metrics": {}},
                                                "smoke_timeout_s": 60, "deploy_timeout_s": 120}),
                      serve_cfg=ingress_app["cfg"], target=target)
    registry.set_alias(ADAPTERS, "champion", "3")
    result = rollout.once("test")
    assert result.status == DEPLOYED and (result.version, result.previous_version) == ("3", "1"), result.line()
    client = openai_client(ingress_app["base_url"])
    ask = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    assert client.chat.completions.create(model="rayline:a", **ask).model == f"rayline:a@{ADAPTERS}/3"
    assert client.chat.completions.create(model="rayline:b", **ask).model == f"rayline:b@{ADAPTERS}/2"
    assert {r["replica_id"] for r in target.replicas() if r["state"] == "RUNNING"} == replicas
