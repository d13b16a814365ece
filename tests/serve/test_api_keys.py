"""API keys of the OpenAI endpoint: the keys files (core/api_keys.py), the gate in front of the routes
(serve/online/api_auth.py), and the session's live app (tests/serve/conftest.py) driven over loopback HTTP with the `openai`
client: no key or a wrong one, caps, a burst over a key's rate, the canary's force header by role, model cards without
storage paths, and no key in any log line of the test stack.

The middleware tests run the real ApiAuth in front of a small ASGI app through httpx's ASGI transport, with the
`openai` SDK as the client, so the error classes asserted are the ones a user's code catches.
"""

from __future__ import annotations

import asyncio
import json
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from core import api_keys
from core.api_keys import ApiKey, hash_key
from pipelines import api_keys as keys_cli
from core.config import ConfigError, from_dict
from serve.online.api_auth import ApiAuth, Gate, KeyStore, Limits, cap_problem
from serve.online.app import routes_deployment_name, served_model_of
from serve.promotion.canary import with_canary
from serve.online.canary_split import ROUTE_HEADER, STATS_PATH
from serve.online.serve_config import AuthConfig
from serve.online.serve_config import Config as ServeConfig
from tests.serve.serving import KEYS_STATE_DIR, LIMITED, free_port, http_json, openai_client, serving_keys

CHAT = {"model": "rayline", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WRONG_KEY = api_keys.new_key()  # sent to the live app once; checked for in the logs too


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- keys files --------------------------------------------------------------------------------------------------

def test_stack_keys_are_private_files_made_once_and_kept(tmp_path):
    keys = api_keys.create_stack_keys(tmp_path)
    client, admin = keys.client_key_file.read_text(), keys.admin_key_file.read_text()
    for f in (keys.client_key_file, keys.admin_key_file, keys.keys_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(keys.folder.stat().st_mode) == 0o700
    entries = {k.id: k for k in api_keys.read_keys_file(keys.keys_file)}
    assert (entries["client"].role, entries["admin"].role) == ("client", "admin")
    assert entries["client"].sha256 == hash_key(client) and client not in keys.keys_file.read_text()
    api_keys.add_key(keys.keys_file, ApiKey.of("ops", "k" * 64, "admin"))  # an operator's own key
    assert api_keys.create_stack_keys(tmp_path).client_key_file.read_text() == client  # again: the same keys
    assert {k.id for k in api_keys.read_keys_file(keys.keys_file)} == {"client", "admin", "ops"}
    assert keys.admin_key_file.read_text() == admin
    assert api_keys.client_env(tmp_path) == {"RAYLINE_API_KEYS_FILE": str(keys.keys_file),
                                             "RAYLINE_ADMIN_KEY_FILE": str(keys.admin_key_file),
                                             "OPENAI_API_KEY": client}


def test_the_cli_prints_a_new_key_once_and_stores_only_its_hash(tmp_path, capsys):
    path = tmp_path / "keys.json"
    for _ in range(2):  # the second time a rotation: the same id, a new key
        assert keys_cli.main(["add", "--keys-file", str(path), "--id", "ops", "--role", "admin", "--rpm", "60"]) == 0
    key = capsys.readouterr().out.split()[-1]
    (entry,) = api_keys.read_keys_file(path)
    assert (entry.id, entry.role, entry.requests_per_minute, entry.sha256) == ("ops", "admin", 60, hash_key(key))
    assert key not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("data, named", [
    ("{", "not JSON"),
    ('{"keys": {}}', '"keys": ['),
    ('{"keys": [{"id": "a"}]}', "keys[0]: expected an object with id and sha256"),
    ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '", "key": "x"}]}', "got keys ['id', 'key', 'sha256']"),
    ('{"keys": [{"id": "a", "sha256": "abc"}]}', "keys[0].sha256: must be the key's sha256"),
    ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '", "role": "root"}]}', "keys[0].role: must be one of"),
    ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '", "requests_per_minute": 0}]}', "requests_per_minute"),
    ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '"}, {"id": "a", "sha256": "' + "1" * 64 + '"}]}',
     "the same id appears twice (a)"),
])
def test_a_bad_keys_file_is_named_with_its_entry_and_field(tmp_path, data, named):
    path = tmp_path / "keys.json"
    path.write_text(data)
    with pytest.raises(ValueError) as e:
        api_keys.read_keys_file(path)
    assert str(path) in str(e.value) and named in str(e.value)


def test_the_admin_key_comes_from_the_config_then_the_env(tmp_path, monkeypatch):
    monkeypatch.delenv(api_keys.ADMIN_KEY_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="auth.admin_key_file.*RAYLINE_ADMIN_KEY_FILE"):
        api_keys.admin_key("")
    (tmp_path / "env").write_text("from-env\n")
    (tmp_path / "cfg").write_text("from-config")
    monkeypatch.setenv(api_keys.ADMIN_KEY_FILE_ENV, str(tmp_path / "env"))
    assert api_keys.admin_key("") == "from-env" and api_keys.admin_key(str(tmp_path / "cfg")) == "from-config"
    with pytest.raises(ValueError, match="missing.*cannot be read"):
        api_keys.admin_key(str(tmp_path / "missing"))


def test_auth_settings_are_checked():
    with pytest.raises(ConfigError, match="auth.keys_file: must be an absolute path"):
        AuthConfig(keys_file="keys.json")
    with pytest.raises(ConfigError, match="auth.max_n"):
        AuthConfig(max_n=0)


def test_the_helpers_use_the_test_stacks_state_dir(stack_cfg):
    assert stack_cfg.state == KEYS_STATE_DIR


# -- the gate's parts --------------------------------------------------------------------------------------------

def test_the_key_store_finds_keys_by_hash_and_follows_the_file(tmp_path):
    path, clock = tmp_path / "keys.json", Clock()
    api_keys.write_keys_file(path, [ApiKey.of("a", "key-a")])
    store = KeyStore(path, recheck_s=5, clock=clock)
    assert store.find("key-a").id == "a" and store.find("key-b") is None and store.find("") is None
    api_keys.add_key(path, ApiKey.of("b", "key-b"))
    assert store.find("key-b") is None  # not rechecked yet
    clock.now += 5
    assert store.find("key-b").id == "b"
    path.write_text("{broken")
    clock.now += 5
    assert store.find("key-a").id == "a"  # the last good keys stay
    with pytest.raises(ValueError, match="absent.json: cannot be read .No such file"):
        KeyStore(tmp_path / "absent.json")


def test_limits_pass_a_minutes_burst_then_one_request_per_refill_and_cap_requests_in_flight():
    clock = Clock()
    limits = Limits(clock)
    key = ApiKey.of("k", "x", requests_per_minute=3, max_concurrent=2)
    assert limits.admit(key) is None and limits.admit(key) is None
    assert limits.admit(key) == ("concurrency", 1.0)
    limits.release(key)
    limits.release(key)
    assert limits.admit(key) is None
    limits.release(key)
    why, retry_s = limits.admit(key)
    assert why == "rate" and retry_s == pytest.approx(20.0)  # 3 a minute: the next one in 20 s
    clock.now += 20
    assert limits.admit(key) is None
    other = ApiKey.of("other", "y", requests_per_minute=3)
    assert limits.admit(other) is None  # each key has its own bucket


def test_caps_on_n_and_tokens():
    assert cap_problem({"n": 9}, 8, 4096)[0] == "n" and cap_problem({"best_of": 9}, 8, 4096)[0] == "best_of"
    assert cap_problem({"max_completion_tokens": 5000}, 8, 4096)[0] == "max_completion_tokens"
    assert cap_problem({"n": 8, "max_tokens": 4096}, 8, 4096) is None
    assert cap_problem({"n": "9", "max_tokens": True}, 8, 4096) is None  # not integers: vLLM's own 400
    assert cap_problem([1, 2], 8, 4096) is None


# -- the middleware, through the openai SDK ----------------------------------------------------------------------

async def _echo(scope, receive, send):
    """A stand-in for the OpenAI app: a chat completion naming the body's size and the force header it got."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    forced = dict(scope["headers"]).get(ROUTE_HEADER.encode(), b"").decode()
    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "rayline", "system_fingerprint": forced,
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": str(len(body))}}]}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(reply).encode()})


class Gated:
    """The real ApiAuth (caps: 4096-byte bodies, n <= 8, 64 tokens) in front of `_echo`, a client key of 2 requests a
    minute and an admin key; `refused` collects the statuses it refused with."""

    def __init__(self, folder: Path):
        self.keys = {"client": "c" * 64, "admin": "a" * 64}
        api_keys.write_keys_file(folder / "keys.json", [ApiKey.of("client", self.keys["client"], requests_per_minute=2),
                                                        ApiKey.of("admin", self.keys["admin"], "admin")])
        self.refused: list[int] = []
        self.app = ApiAuth(_echo, Gate(str(folder / "keys.json"), 4096, 8, 64), on_refused=self.refused.append)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://app")

    def sdk(self, role: str):
        return openai.AsyncOpenAI(base_url="http://app/v1", api_key=self.keys.get(role, role), max_retries=0,
                                  http_client=self.http())


def test_the_sdk_raises_its_own_errors_for_every_refusal(tmp_path):
    gated = Gated(tmp_path)
    client, keys = gated.sdk, gated.keys

    async def scenario():
        ok = await client("client").chat.completions.create(**CHAT)
        assert ok.choices[0].message.content != "0"  # the body reached the app, replayed
        with pytest.raises(openai.AuthenticationError, match="No API key"):
            await client("client").chat.completions.create(**CHAT, extra_headers={"Authorization": openai.omit})
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            await client("w" * 64).chat.completions.create(**CHAT)
        with pytest.raises(openai.PermissionDeniedError, match=ROUTE_HEADER):
            await client("client").chat.completions.create(**CHAT, extra_headers={ROUTE_HEADER: "challenger"})
        forced = await client("admin").chat.completions.create(**CHAT, extra_headers={ROUTE_HEADER: "challenger"})
        assert forced.system_fingerprint == "challenger"  # passed on to the canary split
        with pytest.raises(openai.BadRequestError, match="auth.max_n") as e:
            await client("client").chat.completions.create(**CHAT, n=9)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.RateLimitError, match="2 requests per minute") as e:
            await client("client").chat.completions.create(**CHAT)  # its third in a burst
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.APIStatusError, match="4096 bytes") as e:
            await client("admin").chat.completions.create(**{**CHAT, "user": "x" * 5000})
        assert e.value.status_code == 413
        async with gated.http() as http:
            for path, role, status in ((STATS_PATH, "client", 403), (STATS_PATH, "admin", 200), ("/health", "", 200),
                                       ("/v1/models", "", 401)):
                r = await http.get(path, headers={"Authorization": f"Bearer {keys[role]}"} if role else {})
                assert r.status_code == status, (path, r.text)
                assert r.status_code == 200 or set(r.json()["error"]) == {"message", "type", "param", "code"}

    asyncio.run(scenario())
    assert gated.refused == [401, 401, 403, 400, 429, 413, 403, 401]


def test_a_streamed_body_over_the_limit_is_refused(tmp_path):
    gated = Gated(tmp_path)

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000  # no content-length: the gate counts as it reads

    async def scenario():
        async with gated.http() as http:
            return await http.post("/v1/completions", content=chunks(),
                                   headers={"Authorization": f"Bearer {gated.keys['client']}"})

    r = asyncio.run(scenario())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# -- the live app ------------------------------------------------------------------------------------------------

class StubChallenger(ThreadingHTTPServer):
    """A challenger route on loopback that answers every chat with a fixed completion and keeps what it was sent."""

    def __init__(self):
        self.seen: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                stub.seen.append({"path": self.path, "authorization": self.headers.get("authorization", "")})
                self.rfile.read(int(self.headers.get("content-length", 0)))
                body = json.dumps({"id": "s", "object": "chat.completion", "created": 0, "model": "rayline",
                                   "system_fingerprint": "stub-challenger", "choices": [{
                                       "index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": "stub"}}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def set_canary(served, canary: dict | None) -> None:
    """The session app's canary split (as serve/promotion/canary.py sets it), waited for until its replica reports it."""
    target = served["target"]
    app = target.current()
    cfg = from_dict(ServeConfig, app["args"]["config"])
    target.restore(with_canary(app, routes_deployment_name(cfg), canary))
    stats = served["base_url"].removesuffix("/v1") + STATS_PATH
    deadline = time.time() + 120
    while (reported := http_json(stats, api_key=serving_keys().admin)[1].get("config") or None) != canary:
        assert time.time() < deadline, f"the replica reports canary {reported}, not {canary}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the session's app may start in this test's setup
def test_the_live_app_asks_every_request_for_a_key(served):
    base = served["base_url"]
    client = openai_client(base)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**CHAT, extra_headers={"Authorization": openai.omit})
    with pytest.raises(openai.AuthenticationError):
        openai_client(base, WRONG_KEY).chat.completions.create(**CHAT)
    answer = client.chat.completions.create(**CHAT)
    assert answer.system_fingerprint == served["label"] and answer.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="auth.max_n"):
        client.chat.completions.create(**CHAT, n=9)
    with pytest.raises(openai.BadRequestError, match="auth.max_tokens"):
        client.completions.create(model="rayline", prompt="hi", max_tokens=5000)
    assert http_json(base + "/models", api_key="")[0] == 401
    assert http_json(base.removesuffix("/v1") + STATS_PATH)[0] == 403  # the client key: not rayline's own routes
    limited = openai_client(base, serving_keys().limited)
    outcomes = []
    for _ in range(LIMITED["requests_per_minute"] + 2):  # a burst: faster than the bucket refills (1 per 20 s)
        try:
            limited.completions.create(model="rayline", prompt="hi", max_tokens=1)
            outcomes.append("ok")
        except openai.RateLimitError as e:
            outcomes.append(e.status_code)
    assert outcomes[0] == "ok" and outcomes[-1] == 429, outcomes
    assert outcomes.count("ok") <= LIMITED["requests_per_minute"], outcomes


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_only_an_admin_key_forces_a_canary_side(served):
    stub = StubChallenger()
    canary = {"share": 0.0, "mode": "split", "url": f"http://127.0.0.1:{stub.server_port}", "sticky_header": ""}
    try:
        set_canary(served, canary)
        with pytest.raises(openai.PermissionDeniedError, match=ROUTE_HEADER):
            openai_client(served["base_url"]).chat.completions.create(**CHAT,
                                                                      extra_headers={ROUTE_HEADER: "challenger"})
        assert stub.seen == []
        admin = openai_client(served["base_url"], serving_keys().admin)
        forced = admin.chat.completions.create(**CHAT, extra_headers={ROUTE_HEADER: "challenger"})
        assert forced.system_fingerprint == "stub-challenger"
        assert [s["path"] for s in stub.seen] == ["/v1/chat/completions"]
        assert admin.chat.completions.create(**CHAT).system_fingerprint == served["label"]  # share 0: the champion
    finally:
        set_canary(served, None)
        stub.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_cards_name_versions_never_storage_paths(served):
    source = served_model_of(served["target"].current()).source  # where the replica loads the weights from
    for path in ("/models", "/models/rayline"):
        status, body = http_json(served["base_url"] + path)
        assert status == 200 and source not in json.dumps(body) and '"source"' not in json.dumps(body), body


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_key_appears_in_any_log_line_of_the_test_stack(served, stack_cfg):
    """Last in the module: every key above has been sent (and the wrong one refused) by now."""
    keys = serving_keys()
    secrets = {"client": keys.client, "admin": keys.admin, "limited": keys.limited, "wrong": WRONG_KEY}
    logs = [stack_cfg.state / "logs", Path(stack_cfg.ray_temp_dir) / "session_latest" / "logs"]
    files = [f for d in logs for f in d.rglob("*") if f.is_file() and not f.is_symlink()]
    assert files, logs
    leaks = [(name, str(f)) for f in files for name, key in secrets.items() if key.encode() in f.read_bytes()]
    assert leaks == []
