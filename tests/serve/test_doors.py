"""Every door of the running test stack, tried without credentials and with each wrong role (issue 48).

One table, printed: door, caller, expected, got. A door that should stay shut must answer 401/403 (or refuse the
call); the callers that should get in, get in, so a door shut to everyone cannot pass for a shut one. Real parts
only: the stack's MLflow (basic-auth), Ray's dashboard (token), the served OpenAI app (keys), Swift (S3 keys),
Prometheus, and the rollout's webhook receiver.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from stack import lifecycle as stack, mlflow_auth
from core import registry
from tests.serve.serving import SERVED_MODEL, serving_keys

pytestmark = [pytest.mark.slow]

SHUT, OPEN = "shut", "open"


def http(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None,
         basic: tuple[str, str] | None = None, bearer: str | None = None) -> int:
    """The HTTP status of one request (a refused connection is 0)."""
    h = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
    if basic:
        h["Authorization"] = "Basic " + base64.b64encode(f"{basic[0]}:{basic[1]}".encode()).decode()
    if bearer:
        h["Authorization"] = f"Bearer {bearer}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=h, method=method), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def verdict(status: int) -> str:
    return SHUT if status in (0, 401, 403, 405) else OPEN if 200 <= status < 300 else f"other ({status})"


@pytest.fixture(scope="module")
def doors(local_stack, served):
    cfg = local_stack
    logins = mlflow_auth.ensure_logins(cfg.state)
    mlflow = f"http://127.0.0.1:{cfg.mlflow_port}"
    api = f"{mlflow}/api/2.0/mlflow"
    # The served model is a production model: promoters and the rollout write it, nobody else.
    mlflow_auth.provision(mlflow, cfg.state, [SERVED_MODEL])
    eval_exp = registry.client().get_experiment_by_name(mlflow_auth.EVAL_EXPERIMENT).experiment_id
    alias = {"name": SERVED_MODEL, "alias": "door-test", "version": served["version"]}
    dashboard = f"http://127.0.0.1:{cfg.dashboard_port}"
    keys = serving_keys()
    v1 = served["base_url"]
    env = stack.env_vars(cfg)
    s3 = env.get("AWS_ENDPOINT_URL")
    prom = env.get("RAYLINE_PROMETHEUS_URL")
    rows = [
        # (door, caller, expected, request)
        ("MLflow REST: search models", "anonymous", SHUT, lambda: http(f"{api}/registered-models/search")),
        ("MLflow REST: search models", "wrong password", SHUT,
         lambda: http(f"{api}/registered-models/search", basic=("admin", "not-the-password"))),
        ("MLflow REST: search models", "reader", OPEN,
         lambda: http(f"{api}/registered-models/search", basic=logins["reader"])),
        ("MLflow UI", "anonymous", SHUT, lambda: http(f"{mlflow}/")),
        ("MLflow REST: set alias on a serving model", "anonymous", SHUT,
         lambda: http(f"{api}/registered-models/alias", "POST", alias)),
        *[("MLflow REST: set alias on a serving model", role, SHUT,
           lambda role=role: http(f"{api}/registered-models/alias", "POST", alias, basic=logins[role]))
          for role in ("trainer", "evaluator", "reader")],
        ("MLflow REST: set alias on a serving model", "promoter", OPEN,
         lambda: http(f"{api}/registered-models/alias", "POST", alias, basic=logins["promoter"])),
        *[("MLflow REST: new version of a serving model", role, SHUT,
           lambda role=role: http(f"{api}/model-versions/create", "POST",
                                  {"name": SERVED_MODEL, "source": "s3://elsewhere/model"}, basic=logins[role]))
          for role in ("trainer", "evaluator", "reader")],
        *[("MLflow REST: eval run (the gate's evidence)", role, SHUT,
           lambda role=role: http(f"{api}/runs/create", "POST", {"experiment_id": eval_exp}, basic=logins[role]))
          for role in ("trainer", "promoter", "reader")],
        ("MLflow REST: eval run (the gate's evidence)", "evaluator", OPEN,
         lambda: http(f"{api}/runs/create", "POST", {"experiment_id": eval_exp}, basic=logins["evaluator"])),
        ("MLflow REST: create a webhook", "trainer", SHUT,
         lambda: http(f"{api}/webhooks", "POST", {"name": "x", "url": "https://example.invalid/hook",
                                                  "events": [{"entity": "model_version_alias", "action": "created"}]},
                      basic=logins["trainer"])),
        ("Ray Jobs API", "anonymous", SHUT, lambda: http(f"{dashboard}/api/jobs/")),
        ("Ray Jobs API", "wrong token", SHUT, lambda: http(f"{dashboard}/api/jobs/", bearer="0" * 64)),
        ("Ray Jobs API", "stack token", OPEN, lambda: http(f"{dashboard}/api/jobs/", bearer=stack.ray_token(cfg))),
        ("Ray Serve REST", "anonymous", SHUT, lambda: http(f"{dashboard}/api/serve/applications/")),
        ("Ray Serve REST: deploy", "anonymous", SHUT,
         lambda: http(f"{dashboard}/api/serve/applications/", "PUT", {"applications": []})),
        ("OpenAI: /v1/models", "anonymous", SHUT, lambda: http(f"{v1}/models")),
        ("OpenAI: /v1/models", "wrong key", SHUT, lambda: http(f"{v1}/models", bearer="sk-not-a-key")),
        ("OpenAI: /v1/models", "client key", OPEN, lambda: http(f"{v1}/models", bearer=keys.client)),
        ("OpenAI: force the challenger", "client key", SHUT,
         lambda: http(f"{v1}/completions", "POST", {"model": "rayline", "prompt": "hi", "max_tokens": 1},
                      headers={"x-rayline-canary": "challenger"}, bearer=keys.client)),
    ]
    if s3:
        rows += [("S3: list the bucket", "anonymous (unsigned)", SHUT, lambda: s3_list(s3, cfg.bucket, None, None)),
                 ("S3: list the bucket", "well-known test keys", SHUT, lambda: s3_list(s3, cfg.bucket, "test:tester",
                                                                                        "testing")),
                 ("S3: list the bucket", "stack keys", OPEN,
                  lambda: s3_list(s3, cfg.bucket, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]))]
    if prom:
        rows += [("Prometheus: reload / quit (lifecycle)", "anonymous", SHUT, lambda: http(f"{prom}/-/reload", "POST")),
                 ("Prometheus: delete series (admin)", "anonymous", SHUT, lambda: prometheus_admin(prom))]
    rows += [("webhook receiver", "unsigned", SHUT, unsigned_delivery),
             ("webhook receiver", "signed with the wrong secret", SHUT, lambda: unsigned_delivery("not-the-secret"))]
    table = [(door, caller, expected, verdict(request())) for door, caller, expected, request in rows]
    registry.delete_alias(SERVED_MODEL, "door-test")
    return table


def prometheus_admin(url: str) -> int:
    """Prometheus answers its admin API with 500 "admin APIs disabled" when it is off: that is a shut door."""
    try:
        with urllib.request.urlopen(urllib.request.Request(
                f"{url}/api/v1/admin/tsdb/delete_series?match[]=up", method="POST"), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return 403 if "admin APIs disabled" in e.read().decode() else e.code


def s3_list(endpoint: str, bucket: str, key: str | None, secret: str | None) -> int:
    """ListObjectsV2 on the bucket with these keys (None: an unsigned, anonymous request)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                      region_name="us-east-1", config=Config(signature_version=UNSIGNED) if key is None else None)
    try:
        s3.list_objects_v2(Bucket=bucket, MaxKeys=1)
        return 200
    except ClientError as e:
        status = int(e.response["ResponseMetadata"]["HTTPStatusCode"])
        # Swift hands an unsigned request to its own API, which answers a bucket path with 412 "Bad URL": refused,
        # nothing listed. A 404 would tell the bucket apart from others, so it stays what it is.
        return 403 if 400 <= status < 500 and status != 404 else status


def unsigned_delivery(signed_with: str = "") -> int:
    """A `model_version_alias.created` delivery to a receiver that knows the real secret: unsigned, or signed with
    another secret."""
    import time

    from serve.promotion.webhook import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookReceiver, sign

    called = []
    receiver = WebhookReceiver(SERVED_MODEL, "champion", lambda data, delivery: called.append(delivery),
                               secret="the-real-secret").start()
    try:
        body = {"entity": "model_version_alias", "action": "created",
                "data": {"name": SERVED_MODEL, "alias": "champion", "version": "1"}}
        headers, raw = {}, json.dumps(body)
        if signed_with:
            stamp, delivery = str(int(time.time())), "door-test"
            headers = {DELIVERY_HEADER: delivery, TIMESTAMP_HEADER: stamp,
                       SIGNATURE_HEADER: sign(signed_with, delivery, stamp, raw)}
        status = http(receiver.url, "POST", body, headers=headers)
        assert not called
        return status
    finally:
        receiver.stop()


def test_every_door_that_should_be_shut_is_shut(doors):
    width = max(len(d) for d, *_ in doors)
    print(f"\n{'door':{width}}  {'caller':30} {'expected':8} got")
    for door, caller, expected, got in doors:
        print(f"{door:{width}}  {caller:30} {expected:8} {got}")
    wrong = [row for row in doors if row[2] != row[3]]
    assert not wrong, wrong
