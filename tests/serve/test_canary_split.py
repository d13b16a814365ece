"""The canary's pieces that need no cluster: which side a request goes to, a step's figures and verdict, the split in
an app config, and the errors of bad settings (the canary itself: tests/serve/test_canary.py)."""

from __future__ import annotations

import json

import pytest

from core.config import ConfigError, from_dict
from serve.promotion.canary import judge, load_probe, with_canary
from serve.online.canary_split import CHALLENGER, CHAMPION, CanaryState, Event, _sticky_key, side_of, summarize
from serve.promotion.rollout_config import CanaryConfig


def test_a_user_keeps_its_side_and_only_moves_to_the_challenger_as_the_share_grows():
    users = [f"user-{i}" for i in range(2000)]
    at = {share: {u: side_of(u, share) for u in users} for share in (0.05, 0.25, 0.5, 1.0)}
    for share, sides in at.items():
        assert sides == {u: side_of(u, share) for u in users}  # the same answer every time
        assert abs(sum(s == CHALLENGER for s in sides.values()) / len(users) - share) < 0.03
    for low, high in ((0.05, 0.25), (0.25, 0.5), (0.5, 1.0)):
        assert all(at[high][u] == CHALLENGER for u in users if at[low][u] == CHALLENGER)
    assert side_of("user-1", 0.0) == CHAMPION and side_of(None, 0.0) == CHAMPION
    drawn = [side_of(None, 0.3) for _ in range(4000)]  # no user: drawn at random, at the share
    assert abs(drawn.count(CHALLENGER) / len(drawn) - 0.3) < 0.04


def test_a_chat_without_a_user_is_kept_on_one_side_by_its_opening():
    system = {"role": "system", "content": "Answer briefly."}

    def key(messages, headers=None, sticky_header="", **body):
        return _sticky_key(json.dumps({"model": "rayline", "messages": messages, **body}).encode(), headers or {},
                           sticky_header)

    first = [system, {"role": "user", "content": "What is 3 + 4?"}]
    later = first + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "And twice that?"}]
    assert key(first) == key(later) and key(first).startswith("conversation:")  # every turn of one chat
    assert key([{"role": "user", "content": "What is 3 + 5?"}]) != key([{"role": "user", "content": "What is 3 + 4?"}])
    assert key(first) != key(first[1:])  # another system prompt: another conversation
    # A `user` comes before the conversation, a configured header that was sent before both.
    assert key(later, user="u-1") == "u-1" == key(first, user="u-1")
    assert key(first, {"x-session": "s-9"}, "X-Session", user="u-1") == "s-9"
    assert key(first, {}, "X-Session", user="u-1") == "u-1"
    # Nothing to keep: a completion without `user`, a chat with no user message yet, a body that is not a JSON object.
    assert _sticky_key(json.dumps({"prompt": "hi"}).encode(), {}, "") is None
    assert key([system]) is None
    assert _sticky_key(b"not json", {}, "") is None and _sticky_key(b"[1]", {}, "") is None
    # Many chats split at the share, each to one side.
    chats = [key([{"role": "user", "content": f"What is {a} + {b}?"}]) for a in range(50) for b in range(40)]
    assert abs(sum(side_of(c, 0.25) == CHALLENGER for c in chats) / len(chats) - 0.25) < 0.03


def test_summarize_counts_each_side_and_takes_latencies_of_answered_requests_only():
    events = [Event(0, CHAMPION, True, 0.1 * i, 0.01) for i in range(1, 11)]
    events += [Event(0, CHALLENGER, True, 0.5, None), Event(0, CHALLENGER, False, None, None),
               Event(0, CHALLENGER, True, 0.7, 0.02, shadow=True)]
    s = summarize(events)
    assert s[CHAMPION]["requests"] == 10 and s[CHAMPION]["errors"] == 0
    assert s[CHAMPION]["ttft_p50_s"] == pytest.approx(0.6) and s[CHAMPION]["ttft_p99_s"] == pytest.approx(1.0)
    assert s[CHAMPION]["itl_mean_s"] == pytest.approx(0.01)
    assert s[CHALLENGER]["requests"] == 3 and s[CHALLENGER]["errors"] == 1 and s[CHALLENGER]["shadow"] == 1
    assert s[CHALLENGER]["error_ratio"] == pytest.approx(1 / 3) and s[CHALLENGER]["ttft_p50_s"] == 0.7
    assert summarize([])[CHALLENGER] == {"requests": 0, "errors": 0, "error_ratio": 0.0, "shadow": 0,
                                         "ttft_p50_s": None, "ttft_p99_s": None, "itl_mean_s": None}


def side(requests=20, errors=0, p50=0.1, p99=0.2, itl=0.01):
    return {"requests": requests, "errors": errors, "error_ratio": errors / requests if requests else 0.0,
            "ttft_p50_s": p50, "ttft_p99_s": p99, "itl_mean_s": itl}


def test_judge_passes_a_step_like_the_champion_and_names_each_limit_broken():
    cfg = CanaryConfig(steps=[0.5], min_requests=10, max_error_ratio=0.05, max_ttft_p50_ratio=1.5,
                       max_ttft_p99_ratio=2.0, max_itl_ratio=1.5, latency_slack_s=0.0, max_quality_drop=0.1)
    good = {CHAMPION: side(), CHALLENGER: side(p50=0.12)}
    assert judge(good, {CHAMPION: 0.8, CHALLENGER: 0.75}, cfg) == []
    assert judge({CHAMPION: side(), CHALLENGER: side(requests=4)}, None, cfg) == [
        "only 4 live challenger requests in the step (canary.min_requests 10)"]
    bad = {CHAMPION: side(), CHALLENGER: side(errors=2, p50=0.2, p99=0.5, itl=0.02)}
    problems = judge(bad, {CHAMPION: 0.8, CHALLENGER: 0.5}, cfg)
    assert [p.split(" ")[1] for p in problems] == ["error", "ttft_p50_s", "ttft_p99_s", "itl_mean_s", "exact"]
    assert "canary.max_ttft_p50_ratio 1.5" in problems[1] and "canary.max_quality_drop 0.1" in problems[4]


def test_with_canary_sets_and_removes_the_split_beside_the_adapters():
    app = {"name": "a", "args": {}, "deployments": [{"name": "LLMServer:rayline", "user_config": {"adapters": {"x": {}}}}]}
    split = {"share": 0.25, "mode": "split", "url": "http://127.0.0.1:8000/a-challenger"}
    on = with_canary(app, "LLMServer:rayline", split)
    assert on["deployments"][0]["user_config"] == {"adapters": {"x": {}}, "canary": split}
    off = with_canary(on, "LLMServer:rayline", None)  # off is explicit: Serve reconfigures only with a user_config
    assert off["deployments"][0]["user_config"] == {"adapters": {"x": {}}, "canary": None}
    bare = {"name": "a", "args": {}}
    assert with_canary(bare, "LLMServer:rayline", split)["deployments"] == [
        {"name": "LLMServer:rayline", "user_config": {"canary": split}}]
    assert with_canary(bare, "LLMServer:rayline", None) == bare


def test_bad_canary_settings_are_refused_with_the_field_named(tmp_path, monkeypatch):
    state = CanaryState()
    for config, field in (({"share": 1.5, "url": "http://x"}, "canary.share"),
                          ({"share": 0.5, "mode": "both", "url": "http://x"}, "canary.mode"),
                          ({"share": 0.5, "url": "x:8000"}, "canary.url")):
        with pytest.raises(ValueError, match=field):
            state.configure(config)
    state.configure({"share": 0.5, "url": "http://127.0.0.1:8000/c"})
    assert state.active
    state.configure(None)
    assert not state.active
    for canary, field in (({"steps": [0.5, 0.25]}, "canary.steps"), ({"steps": [0, 0.5]}, "canary.steps"),
                          ({"step_s": 0}, "canary.step_s"), ({"route_prefix": "x"}, "canary.route_prefix"),
                          ({"metrics": "logs"}, "metrics: .logs. is not one of"), ({"metrics_lag_s": -1}, "canary.metrics_lag_s"),
                          ({"prometheus_url": "127.0.0.1:9090"}, "canary.prometheus_url")):
        with pytest.raises(ConfigError, match=field):
            from_dict(CanaryConfig, canary)
    monkeypatch.delenv("RAYLINE_PROMETHEUS_URL", raising=False)
    with pytest.raises(ConfigError, match="canary.prometheus_url: canary.metrics is prometheus, but no URL"):
        from_dict(CanaryConfig, {"metrics": "prometheus"}).metrics_url()
    assert from_dict(CanaryConfig, {}).metrics_url() == ""  # auto without a Prometheus: the replicas' stats
    monkeypatch.setenv("RAYLINE_PROMETHEUS_URL", "http://127.0.0.1:9190")
    assert from_dict(CanaryConfig, {}).metrics_url() == "http://127.0.0.1:9190"
    assert from_dict(CanaryConfig, {"metrics": "replicas"}).metrics_url() == ""
    probe = tmp_path / "probe.jsonl"
    probe.write_text("\ufeff" + json.dumps({"messages": [{"role": "user", "content": "1+1?"},
                                                         {"role": "assistant", "content": "2"}]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(ValueError, match=r"probe.jsonl line 2: no answer"):
        load_probe(str(probe))
    probe.write_text(probe.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    assert load_probe(str(probe)) == [([{"role": "user", "content": "1+1?"}], "2")]
