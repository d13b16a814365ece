"""Champion and challenger for real: `challenger` set in MLflow, the canary steps under a bounded loopback load, the
challenger promoted or rolled back (real Serve, vLLM on CPU, MLflow server, openai client).

One champion app of two replicas for the module (v1), each step judged on both from the stack's Prometheus. The
quality probe's known answers are v1's own greedy answers, so a copy of v1's weights (v2) matches them and a model
of other weights (v3) does not. In order:
  the module's first rollout (v1, no canary) with `target: kubernetes`: written into a RayService through the API
      server and operator stand-ins (tests/serve/kube_api.py), which apply it to the real Serve;
  `challenger` added to v2 in the MLflow UI (headless Chromium) wakes `pipelines.rollout --watch` through MLflow's
      webhook: a split canary of 2 steps under load from clients with a `user` each: zero failed requests, each user
      answered by one version within a step, the challenger's share within a few points, v2 becomes champion;
  shadow canary of v3 (answers wrong on the probe) with `target: kubernetes` (a RayService through the API server
      and operator stand-ins, tests/serve/kube_api.py): no client ever gets a challenger answer, the challenger
      answered copies, rolled back after its step, the champion answering throughout, the reason on the run and
      the version, `challenger` removed;
  a challenger that answers right but fails live requests (its app lost in the step), and one that answers right but
      slowly (its replica paused), each rolled back on the stack's Prometheus figures (error ratio, TTFT) with the
      probe passing it and no client request failed; a step with no live requests in Prometheus fails.
The promotion (the champion app rebuilt on v2) runs beside a stand-in for another stack's Serve proxy on Ray's default
fallback port (tests/serve/foreign_proxy.py): no request may reach it (issue 51's 404s).
A champion replaced under load with no failed request is asserted by the canary's promotion (here) and by
tests/serve/test_rollout.py; the Serve rolling update beneath is the same for either target.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, defaultdict
from urllib.parse import urlparse

import pytest
import yaml

from core import registry
from core.config import from_dict
from stack.tiny_model import build_tiny_model
from serve.promotion.canary import TAG_CANARY_REASON, TAG_CANARY_STATUS
from serve.promotion.deploy_target import LocalServe
from serve.promotion.outcome import DEPLOYED, ROLLED_BACK
from serve.promotion.rollout import Rollout
from serve.promotion.rollout_config import Config as RolloutConfig
from serve.online.serve_config import Config as ServeConfig
from tests.serve.foreign_proxy import ForeignServeProxy, haproxy_fallbacks
from tests.serve.serving import free_port, openai_client, register_fresh, serve_config_dict
from tests.serve.load import LoadThreads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MODEL = "rayline-canary-test"
APP = "rayline-test-canary"
PREFIX = "/canary-test"
PROMPTS = ["What is 2 + 2?", "Name a colour.", "Is 7 odd?", "Say hi.", "Count to three.", "What comes after 4?"]
# Steps judged on the stack's Prometheus (2 s replica reports + 5 s scrapes: a step's figures are stored 8 s after it),
# over both champion replicas; 12 s steps span two or three scrapes.
CANARY = {"steps": [0.25, 0.5], "step_s": 12, "metrics": "prometheus", "metrics_lag_s": 8,
          "min_requests": 5, "max_error_ratio": 0.0, "probe_size": 6, "probe_max_tokens": 4, "max_quality_drop": 0.34,
          # the same model on both sides: latency limits loose enough for a busy 2-core box, tight enough for a hang
          "max_ttft_p50_ratio": 5.0, "max_ttft_p99_ratio": 10.0, "max_itl_ratio": 5.0, "latency_slack_s": 0.2}


class UserLoad(LoadThreads):
    """Loopback clients sending chat completions as random users of a pool; every answer kept with its user, start
    time and the version that answered (`system_fingerprint`). The first client instead holds two-turn chats without
    a `user` (each its own conversation, kept on one version by its opening). Bounded in time."""

    def __init__(self, base_url: str, clients: int = 3, users: int = 200, limit_s: float = 900):
        super().__init__(clients, self._run)
        self.client = openai_client(base_url)
        self.users, self.stop_at = users, time.time() + limit_s
        self.answers: list[tuple[float, str, str | None]] = []
        self.errors: list[str] = []

    def _ask(self, key: str, messages: list[dict], user: str | None) -> str | None:
        """One request; its answer's text (None on failure, counted), the answer kept under `key`."""
        t = time.time()
        try:
            r = self.client.chat.completions.create(model="rayline", messages=messages, max_tokens=6, temperature=0.0,
                                                    **({"user": user} if user else {}))
            self.answers.append((t, key, r.system_fingerprint))
            return r.choices[0].message.content or ""
        except Exception as e:  # every failure counts; the tests assert there are none
            self.errors.append(f"{time.time() - t:.1f}s {type(e).__name__}: {e}")
            time.sleep(0.5)
            return None

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set() and time.time() < self.stop_at:
            if i == 0:
                key = f"chat-{rng.randrange(10**9)}"
                messages = [{"role": "user", "content": f"What is {rng.randrange(100)} + {rng.randrange(100)}?"}]
                answer = self._ask(key, messages, None)
                if answer is not None:
                    self._ask(key, messages + [{"role": "assistant", "content": answer},
                                               {"role": "user", "content": "And twice that?"}], None)
            else:
                user = f"user-{rng.randrange(self.users)}"
                self._ask(user, [{"role": "user", "content": rng.choice(PROMPTS)}], user)
            time.sleep(0.05)

    def between(self, start: float, end: float) -> list[tuple[str, str | None]]:
        return [(u, fp) for t, u, fp in list(self.answers) if start <= t < end]


@pytest.fixture(scope="module")
def setup(local_stack, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("canary")
    other = build_tiny_model(tmp / "other", "tiny", seed=7)
    versions = register_fresh(MODEL, [
        (str(tiny_model_dir), {"eval.exact_match": "0.6"}),  # v1: the champion
        (str(tiny_model_dir), {"eval.exact_match": "0.7"}),  # v2: the same weights, a healthy challenger
        (str(other), {"eval.exact_match": "0.8"}),           # v3: other weights, wrong on the probe
    ])
    assert versions == ["1", "2", "3"]
    # Two champion replicas: the split runs on both, and a step is judged on both (Prometheus), not on the one
    # replica a stats request would reach.
    serve_cfg = from_dict(ServeConfig, {**serve_config_dict(APP, PREFIX, MODEL),
                                        "autoscaling": {"min_replicas": 2, "max_replicas": 2}})
    registry.set_alias(MODEL, "champion", "1")

    def rollout(target=None, options: dict | None = None, **canary) -> Rollout:
        cfg = from_dict(RolloutConfig, {"model": MODEL, "serve_config": "unused", "gate": {"min_metrics": {}},
                                        "canary": {**CANARY, "probe_uri": str(probe), **canary}, **(options or {})})
        return Rollout(cfg, serve_cfg, target)

    probe = tmp / "probe.jsonl"
    probe.write_text("")
    base_url = f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}/v1"
    # The first rollout goes through a RayService that does not hold the app yet (as on a cluster whose RayService
    # carries other apps); test_the_first_rollout_on_kubernetes_went_through_the_rayservice reads what it did.
    api, operator, first_rollout = on_kubernetes(rollout, base_url, app=None)
    with operator:
        first = first_rollout.once("test:setup")
    assert operator.errors == [], operator.errors
    assert first.status == DEPLOYED and first.version == "1", first.line()
    client = openai_client(base_url)
    with probe.open("w") as f:  # known answers: the champion's own greedy ones
        for p in PROMPTS:
            messages = [{"role": "user", "content": p}]
            answer = client.chat.completions.create(model="rayline", messages=messages, max_tokens=4,
                                                    temperature=0.0).choices[0].message.content
            f.write(json.dumps({"messages": messages + [{"role": "assistant", "content": answer}]}) + "\n")
    try:
        yield {"rollout": rollout, "base_url": base_url, "first": first, "first_writes": list(api.writes)}
    finally:
        LocalServe(APP).delete()
        LocalServe(f"{APP}-challenger").delete()


def canary_steps(run_id: str) -> list[dict]:
    with open(registry.client().download_artifacts(run_id, "canary_steps.json")) as f:
        return json.load(f)


def served_by(base_url: str) -> str:
    return openai_client(base_url).chat.completions.create(
        model="rayline", messages=[{"role": "user", "content": "ping"}], max_tokens=2).system_fingerprint


def on_kubernetes(rollout, base_url: str, app: str | None = APP, **canary):
    """A RayService holding the module's app as it runs now (`app`; None: without it), the API server stand-in
    (every write validated against the CRD), the operator stand-in that applies it to the real Serve, and a rollout
    (made by `rollout`, the setup's factory) with `target: kubernetes` on it."""
    from serve.promotion.deploy_target import KubeRayService
    from tests.serve.kube_api import KubeApiStandIn, OperatorStandIn

    obj = next(d for d in yaml.safe_load_all(open("rayjobs/rendered/serve-gpu.yaml")) if d)
    obj["metadata"].update(name="rayline-canary", namespace="rayline")
    # The stack's Serve HTTP options, as a RayService's serveConfigV2 carries its cluster's: the operator sends them
    # with the apps, and Serve, started by the first of its PUTs, keeps them.
    http = {"host": "127.0.0.1", "port": urlparse(base_url).port}
    obj["spec"]["serveConfigV2"] = yaml.safe_dump({"http_options": http,
                                                   "applications": [LocalServe(app).current()] if app else []})
    api = KubeApiStandIn(obj)
    target = rollout(KubeRayService(APP, "rayline-canary", "rayline", api=api),
                     {"target": "kubernetes", "kubernetes": {"name": "rayline-canary", "namespace": "rayline",
                                                             "serve_url": base_url}}, **canary)
    return api, OperatorStandIn(api, "rayline", "rayline-canary", LocalServe(APP)), target


def test_the_first_rollout_on_kubernetes_went_through_the_rayservice(setup):
    """The module's first rollout (no canary, `target: kubernetes`): the RayService's serveConfigV2 patched once, at
    the resourceVersion read, with the app pinned to v1; the operator stand-in applied it and v1 answers."""
    first = setup["first"]
    assert (first.previous_version, first.version) == (None, "1"), first.line()
    (write,) = setup["first_writes"]  # one patch, carrying the resourceVersion it was computed from
    assert write["metadata"]["resourceVersion"]
    (app,) = yaml.safe_load(write["spec"]["serveConfigV2"])["applications"]
    assert app["name"] == APP and app["args"]["model"]["version"] == "1"
    run = registry.client().get_run(first.run_id)
    assert run.data.tags["rollout.target"] == f"RayService rayline/rayline-canary (app {APP!r})"
    assert run.data.tags["rollout.status"] == "deployed"
    assert served_by(setup["base_url"]) == f"{MODEL}/1"


def test_challenger_set_in_the_mlflow_ui_takes_its_shares_and_becomes_champion(setup, tmp_path, local_stack):
    """`pipelines.rollout --watch` with canary steps; a trainer's clicks in the MLflow UI change nothing, then a
    promoter adds `challenger` to v2 there (headless Chromium, the UI's own controls, each logged in as itself),
    MLflow's webhook wakes the watch, the canary runs under load and promotes v2."""
    import mlflow

    from stack import mlflow_auth
    from tests.serve.mlflow_ui import add_alias_in_ui, browser_missing

    if browser_missing():
        pytest.skip(f"the MLflow UI test needs a browser: {browser_missing()}")
    # The module's model serves, so it is a production model: its promoters and the rollout are its only writers.
    mlflow_auth.provision(mlflow.get_tracking_uri(), local_stack.state, [MODEL])
    logins = mlflow_auth.ensure_logins(local_stack.state)
    v1, v2 = f"{MODEL}/1", f"{MODEL}/2"
    rollout = setup["rollout"](options={"watch": True, "poll_interval_s": 600, "max_rollouts": 1,
                                        "webhook_port": free_port(), "register_webhook": True})
    done: list = []
    watch = threading.Thread(target=lambda: done.append(rollout.watch()), daemon=True)
    hooks = registry.client()
    try:
        # Beside another stack's Serve proxy on Ray's default fallback port (where that port is free; the stand-in
        # answers 404 to everything): what took 168 of a promotion's requests when the stacks shared that port.
        with ForeignServeProxy() as foreign, UserLoad(setup["base_url"]) as load:
            watch.start()
            deadline = time.time() + 60
            while not any(h.name == f"rayline-rollout-{MODEL}" for h in hooks.list_webhooks()):
                assert time.time() < deadline, "the watching rollout registered no webhook"
                time.sleep(0.2)
            time.sleep(1)
            with pytest.raises(AssertionError, match="did not take alias 'challenger'"):
                add_alias_in_ui(mlflow.get_tracking_uri(), MODEL, "2", "challenger", tmp_path, timeout_s=15,
                                login=logins["trainer"])
            assert registry.get_alias(MODEL, "challenger") is None and not done  # the trainer's clicks: no change
            set_at = time.time()
            add_alias_in_ui(mlflow.get_tracking_uri(), MODEL, "2", "challenger", tmp_path, login=logins["promoter"])
            watch.join(timeout=420)
            done_at = time.time()
            time.sleep(3)
    finally:
        for h in hooks.list_webhooks():
            if h.name == f"rayline-rollout-{MODEL}":
                hooks.delete_webhook(h.webhook_id)
    ((result,),) = done
    assert result.status == DEPLOYED and (result.previous_version, result.version) == ("1", "2"), result.line()
    assert registry.client().get_model_version(MODEL, "2").tags["rollout.triggered_by"].startswith(
        "webhook:"), "the poll (600 s), not MLflow's webhook call, started the canary"
    assert load.errors == [], load.errors[:5]
    run = registry.client().get_run(result.run_id)
    steps = canary_steps(result.run_id)
    assert [s["share"] for s in steps] == [0.25, 0.5] and all(s["passed"] for s in steps), steps
    # The promotion (the champion app rebuilt on v2: deploy -> v2 answering, `switch_s`) dropped no request: the load
    # ran through it, none failed (above), none reached another stack's proxy, and the stack's HAProxy falls back to
    # its own Serve proxy while the app is rebuilt, not to Ray's port that every stack would share.
    switch_s = run.data.metrics["switch_s"]
    promoted = load.between(done_at - switch_s, done_at)
    assert len(promoted) >= switch_s, (switch_s, Counter(fp for _, fp in promoted))  # 3 clients: several a second
    assert foreign.hits == 0, f"{foreign.hits} requests reached another stack's Serve proxy"
    assert haproxy_fallbacks(local_stack) == {local_stack.serve_fallback_ports[0]}, haproxy_fallbacks(local_stack)
    print(f"promotion: {len(promoted)} requests answered, 0 failed; foreign proxy on "
          f"{foreign.port}: {'bound' if foreign.bound else 'held by another process'}")
    first_canary_s = run.data.metrics["first_canary_s"]
    print(f"\nchallenger set -> first canary step: {first_canary_s:.1f}s; whole canary {done_at - set_at:.1f}s; "
          f"{len(load.answers)} requests")
    assert first_canary_s <= 120
    for s in steps:
        # Within a step the shares hold: the challenger's fraction of live requests near the configured share, and
        # every user answered by one version only (sticky by `user`).
        ch, cp = s["sides"]["challenger"]["requests"], s["sides"]["champion"]["requests"]
        assert ch + cp >= 40 and abs(ch / (ch + cp) - s["share"]) < 0.15, s
        # The figures are both replicas' (one replica's would be about half the clients' requests): every request
        # the clients sent in the window Prometheus read, give or take the replicas' 2 s report interval.
        assert s["metrics"]["source"] == "prometheus", s
        start, end = s["metrics"]["window"]
        sent = len(load.between(start, end))
        assert end - start >= 5 and 0.75 * sent <= ch + cp <= 1.25 * sent, (sent, s)
        assert s["probe"] == {"champion": 1.0, "challenger": 1.0}
    chat_sides = set()
    for s in steps:  # the replicas took the share before the step began; users, and chats without one, are sticky
        by_user = defaultdict(set)
        for user, fp in load.between(s["started_at"] + 0.5, s["started_at"] + s["window_s"] - 0.5):
            by_user[user].add(fp)
        assert by_user and all(len(fps) == 1 for fps in by_user.values()), dict(by_user)
        chat_sides |= {fp for k, fps in by_user.items() if k.startswith("chat-") and len(fps) == 1 for fp in fps}
    assert chat_sides == {v1, v2}  # chats without a `user` were split too, not all kept on the champion
    seen = Counter(fp for _, _, fp in load.answers)
    assert set(seen) == {v1, v2}
    assert served_by(setup["base_url"]) == v2
    assert str(registry.get_alias(MODEL, "champion").version) == "2" and registry.get_alias(MODEL, "challenger") is None
    tags = registry.client().get_model_version(MODEL, "2").tags
    assert tags[TAG_CANARY_STATUS] == "promoted" and tags["rollout.status"] == "deployed"
    assert registry.client().get_model_version(MODEL, "1").tags["rollout.status"] == "retired"
    assert LocalServe(f"{APP}-challenger").current() is None
    assert run.data.metrics["canary.challenger.requests"] > 0 and run.data.tags["rollout.kind"] == "canary"
    # The replicas' canary metrics reach the stack's Prometheus (the serving dashboard's canary panels).
    from core import prometheus_query
    from stack.lifecycle import env_vars

    url = env_vars(local_stack)["RAYLINE_PROMETHEUS_URL"]
    for expr in (f'sum by (role) (ray_rayline_canary_requests_total{{app="{APP}",mode="live"}})',
                 f'sum by (role) (ray_rayline_canary_ttft_seconds_count{{app="{APP}"}})'):
        deadline = time.time() + 90
        while {s["metric"]["role"] for s in prometheus_query.query(url, expr)} != {"champion", "challenger"}:
            assert time.time() < deadline, f"{expr}: {prometheus_query.query(url, expr)}"
            time.sleep(2)


def test_shadow_canary_on_kubernetes_never_returns_a_challenger_answer(setup):
    """The same canary with `target: kubernetes`: the challenger app and the split are written to a RayService's
    serveConfigV2, which the operator stand-in applies to the real Serve as KubeRay's operator does."""
    v2 = f"{MODEL}/2"
    api, operator, rollout = on_kubernetes(setup["rollout"], setup["base_url"], mode="shadow", steps=[1.0])
    with operator, UserLoad(setup["base_url"], clients=2) as load:
        registry.set_alias(MODEL, "challenger", "3")
        result = rollout.once("test:shadow")
    assert operator.errors == []
    assert result.status == ROLLED_BACK and result.version == "3", result.line()
    assert "step 0 (100% shadow) failed" in result.reason and "probe exact match" in result.reason
    assert load.errors == [], load.errors[:5]
    assert load.answers and {fp for _, _, fp in load.answers} == {v2}  # the champion throughout, never v3
    assert served_by(setup["base_url"]) == v2 and str(registry.get_alias(MODEL, "champion").version) == "2"
    assert registry.get_alias(MODEL, "challenger") is None
    tags = registry.client().get_model_version(MODEL, "3").tags
    assert tags[TAG_CANARY_STATUS] == "rolled_back" and "probe exact match" in tags[TAG_CANARY_REASON]
    run = registry.client().get_run(result.run_id)
    assert run.data.tags["rollout.status"] == "rolled_back" and "probe exact match" in run.data.tags["rollout.reason"]
    steps = canary_steps(result.run_id)
    shadow = steps[0]["sides"]["challenger"]
    assert shadow["requests"] >= 5 and shadow["shadow"] == shadow["requests"] and shadow["errors"] == 0, steps
    # Every change went through the RayService: the challenger app added, the split set and switched off, the
    # challenger removed; what is left is the champion's app with the split off.
    configs = [yaml.safe_load(w["spec"]["serveConfigV2"]) for w in api.writes]
    assert any(f"{APP}-challenger" in {a["name"] for a in c["applications"]} for c in configs)
    splits = [d.get("user_config", {}).get("canary") for c in configs for a in c["applications"] if a["name"] == APP
              for d in a.get("deployments") or []]
    assert [(s["share"], s["mode"]) for s in splits if s] == [(1.0, "shadow")] and splits[-1] is None, splits
    assert [a["name"] for a in configs[-1]["applications"]] == [APP]
    assert LocalServe(f"{APP}-challenger").current() is None


def once_split(fault, limit_s: float = 600) -> threading.Thread:
    """A thread that runs `fault()` once the champion's replicas were given a canary split (the step has begun)."""
    champion = LocalServe(APP)

    def wait_then_fault() -> None:
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if any((d.get("user_config") or {}).get("canary")
                   for d in (champion.current() or {}).get("deployments") or []):
                time.sleep(1)  # into the step's window
                fault()
                return
            time.sleep(0.5)

    return threading.Thread(target=wait_then_fault, daemon=True)


def test_a_challenger_that_errors_is_rolled_back_on_prometheus_figures(setup):
    """A challenger that passes the probe (v1: v2's weights) but fails live requests: its app goes away during the
    step (a fault: the challenger's replicas lost), so every request the split sends it fails and the champion
    answers it instead. The step is judged on the stack's Prometheus: the challenger's error ratio rolls it back,
    while no client saw a failure and the probe alone would have passed it."""
    v2 = f"{MODEL}/2"
    rollout = setup["rollout"](steps=[0.5], step_s=12)
    removed: list[float] = []
    fault = once_split(lambda: (LocalServe(f"{APP}-challenger").delete(), removed.append(time.time())))
    with UserLoad(setup["base_url"], clients=2) as load:
        registry.set_alias(MODEL, "challenger", "1")
        fault.start()
        result = rollout.once("test:errors")
        fault.join(timeout=60)
    assert removed, "the challenger app was never removed: the split was never set"
    assert result.status == ROLLED_BACK and result.version == "1", result.line()
    assert load.errors == [], load.errors[:5]  # the champion answered what the challenger could not
    (step,) = canary_steps(result.run_id)
    assert step["metrics"]["source"] == "prometheus", step
    ch = step["sides"]["challenger"]
    assert ch["requests"] >= 5 and ch["errors"] > 0 and ch["error_ratio"] > 0, step
    assert step["probe"]["challenger"] == step["probe"]["champion"], step  # not the probe: the live figures
    assert any("challenger error ratio" in p for p in step["problems"]), step["problems"]
    assert "challenger error ratio" in result.reason
    assert served_by(setup["base_url"]) == v2 and registry.get_alias(MODEL, "challenger") is None
    assert registry.client().get_model_version(MODEL, "1").tags[TAG_CANARY_STATUS] == "rolled_back"


def test_a_slow_challenger_is_rolled_back_on_prometheus_figures(setup):
    """A challenger that answers right (v1: v2's weights; the probe passes it) but slowly: its replica's process is
    paused 2.5 s of every 2.7 s during the step (a fault: a starved or swapping machine). The step is judged on the
    stack's Prometheus: the challenger's time to first token against the champion's rolls it back, with no client
    request failed."""
    import os
    import signal

    v2 = f"{MODEL}/2"
    rollout = setup["rollout"](steps=[0.5], step_s=12, min_requests=3, max_ttft_p50_ratio=2.0, latency_slack_s=0.2)
    stop, paused = threading.Event(), []

    def pause_the_challenger() -> None:
        pids = [r["pid"] for r in LocalServe(f"{APP}-challenger").replicas() if r["state"] == "RUNNING" and r["pid"]]
        paused.extend(pids)
        until = time.time() + CANARY["step_s"] + CANARY["metrics_lag_s"]  # the step's window, then it runs freely
        while not stop.is_set() and time.time() < until:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            stop.wait(2.5)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            stop.wait(0.2)

    fault = once_split(pause_the_challenger)
    try:
        with UserLoad(setup["base_url"]) as load:
            registry.set_alias(MODEL, "challenger", "1")
            fault.start()
            result = rollout.once("test:slow")
    finally:
        stop.set()
        fault.join(timeout=30)
    assert paused, "the challenger was never paused: the split was never set"
    assert result.status == ROLLED_BACK and result.version == "1", result.line()
    assert load.errors == [], load.errors[:5]
    (step,) = canary_steps(result.run_id)
    assert step["metrics"]["source"] == "prometheus", step
    ch, cp = step["sides"]["challenger"], step["sides"]["champion"]
    assert ch["requests"] >= 3 and ch["errors"] == 0 and ch["ttft_p50_s"] > cp["ttft_p50_s"], step
    assert step["probe"]["challenger"] == step["probe"]["champion"], step  # not the probe: the live figures
    # a paused replica answers the requests that reach it in its running 0.2 s at once, so its p50 or its p99 trips
    # (whichever the step's mix of requests makes slower), never another figure
    assert any(p.startswith("challenger ttft_p") for p in step["problems"]), step["problems"]
    assert served_by(setup["base_url"]) == v2 and registry.get_alias(MODEL, "challenger") is None


def test_a_canary_step_without_evidence_fails(setup):
    """A step in which Prometheus holds no live canary requests (no client sent any) fails, even with min_requests 0:
    the canary never passes on figures it does not have. Run on the champion's replicas without a challenger app
    (the split points at its route; no request goes there), as `Canary.run` runs each step."""
    from serve.promotion.canary import Canary

    rollout = setup["rollout"](steps=[0.25], step_s=6, min_requests=0, probe_uri="")
    canary = Canary(rollout)
    canary._version = "1"
    steps: list[dict] = []
    with registry.start_run("rayline-tests", "canary-without-evidence"):
        try:
            reason = canary._steps(steps, time.time())
        finally:
            canary._split(None)
    (step,) = steps
    assert step["metrics"]["source"] == "prometheus" and not step["passed"], step
    assert step["sides"]["challenger"]["requests"] == step["sides"]["champion"]["requests"] == 0, step
    assert "holds no canary requests" in reason, reason
