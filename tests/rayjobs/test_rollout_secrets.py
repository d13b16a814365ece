"""The rollout's own Secrets in the renders (issue #48 follow-ups): the OpenAI endpoint's admin key, which its smoke
requests, canary probes and stats send, and the secret MLflow signs webhook deliveries with. Only the rollout's Ray
pods mount them (the webhook secret only when the rendered config sets `webhook_port`), the rollout reads them where
they land, and a render giving either to any other pod fails validation at that manifest's field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, load_config
from pipelines.validate import main as validate_cli
from rayjobs import render, stages
from tests.rayjobs.shipped_pods import HEAD, SERVE_WORKER, at, pods, shipped
from rayjobs.cluster_profile import Profile
from rayjobs.credentials import ADMIN_KEY_FILE, WEBHOOK_SECRET_FILE
from rayjobs.validate import validate_manifest
from serve.promotion.rollout import load_serve_config
from serve.promotion.rollout_config import Config as RolloutConfig
from serve.promotion.verify import admin_key

ROOT = stages.PROJECT_ROOT
ROLLOUT = str(ROOT / "configs/rollout/tiny.yaml")
WEBHOOK = ["watch=true", "webhook_port=8765", "webhook_host=0.0.0.0"]
ADMIN, HOOK = "rayline-openai-admin-key", "rayline-mlflow-webhook"
# What the Secrets hold in these tests (the pods only name them).
SECRETS = {"rayline-mlflow-rollout": {"username": "rollout", "password": "pw"}, ADMIN: {"admin_key": "admin-key-1"},
           HOOK: {"secret": "hook-secret-1"}}


@pytest.fixture(scope="module")
def profile():
    return render.load_profile(None)




def _secrets_mounted(pod: dict) -> set[str]:
    return {v["secret"]["secretName"] for v in pod["spec"].get("volumes", []) if "secret" in v}


def _kubelet(pod: dict, root: Path) -> dict[str, str]:
    """Lay the pod's Secret volumes out under `root` as the kubelet would (SECRETS' values, each listed item at its
    mount path) and return the Ray container's plain env, its paths under the secrets' folder moved under `root`."""
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        for item in (secret or {}).get("items", []):
            f = root / mount["mountPath"].lstrip("/") / item["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(SECRETS[secret["secretName"]][item["key"]] + "\n")
    return {e["name"]: f"{root}{e['value']}" if e["value"].startswith("/var/run/secrets/") else e["value"]
            for e in container["env"] if "value" in e}


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_only_the_rollouts_ray_pods_mount_the_admin_key_and_none_the_webhook_secret_by_default(fname):
    rollout = render.SHIPPED[fname][0] == "rollout"
    for name, pod in pods(shipped(fname)):
        mounted = _secrets_mounted(pod)
        assert (ADMIN in mounted) is (rollout and name != "submitter"), (fname, name)
        assert HOOK not in mounted, (fname, name)  # configs/rollout/tiny.yaml takes no webhooks (webhook_port: 0)
        env = {e["name"]: e.get("value") for c in pod["spec"]["containers"] for e in c.get("env", [])}
        assert ("RAYLINE_ADMIN_KEY_FILE" in env) is (rollout and name != "submitter")
        assert "RAYLINE_WEBHOOK_SECRET_FILE" not in env


def test_the_rollout_reads_its_admin_key_where_the_pod_mounts_it(tmp_path, monkeypatch):
    cfg = load_config(RolloutConfig, ROLLOUT)
    serve_cfg = load_serve_config(cfg)
    assert serve_cfg.auth.admin_key_file == ""  # else the config's path would win over the mounted file's env var
    head = pods(shipped("rollout-tiny.yaml"))[0][1]
    (container,) = head["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/run/secrets/rayline/openai-admin")
    assert mount["readOnly"] is True
    volume = next(v for v in head["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == ADMIN and volume["secret"]["items"] == [{"key": "admin_key", "path": "admin_key"}]
    env = _kubelet(head, tmp_path)
    assert env["RAYLINE_ADMIN_KEY_FILE"] == f"{tmp_path}{ADMIN_KEY_FILE}"
    monkeypatch.setenv("RAYLINE_ADMIN_KEY_FILE", env["RAYLINE_ADMIN_KEY_FILE"])
    assert admin_key(serve_cfg) == "admin-key-1"  # what serve/promotion/verify.py sends on the smoke requests


def test_a_rollout_with_webhook_port_mounts_the_webhook_secret_and_reads_it(tmp_path, monkeypatch, profile):
    docs = render.render_documents("rollout", ROLLOUT, profile, WEBHOOK)
    assert render.validate_rendered(docs, profile) == []
    assert [d["kind"] for d in docs] == ["RayJob", "NetworkPolicy", "NetworkPolicy"]
    by_name = dict(pods(docs[0]))
    assert all(HOOK in _secrets_mounted(by_name[n]) for n in ("head", "cpu-workers"))
    assert HOOK not in _secrets_mounted(by_name["submitter"])
    head = by_name["head"]["spec"]["containers"][0]
    assert {"name": "mlflow-webhook", "containerPort": 8765} in head["ports"]
    env = _kubelet(by_name["head"], tmp_path)
    assert env["RAYLINE_WEBHOOK_SECRET_FILE"] == f"{tmp_path}{WEBHOOK_SECRET_FILE}"
    monkeypatch.setenv("RAYLINE_WEBHOOK_SECRET_FILE", env["RAYLINE_WEBHOOK_SECRET_FILE"])
    assert load_config(RolloutConfig, ROLLOUT, WEBHOOK).webhook_secret() == "hook-secret-1"  # what the receiver checks


@pytest.mark.parametrize("overrides, field", [
    (["webhook_port=8765"], "webhook_host"),  # the default 127.0.0.1: MLflow could never deliver
    (WEBHOOK + ["webhook_secret_file=/etc/hook"], "webhook_secret_file"),
    (["watch=true", "webhook_port=8265", "webhook_host=0.0.0.0"], "webhook_port"),  # the dashboard's
    (["serve_overrides=[auth.admin_key_file=/etc/admin_key]"], "auth.admin_key_file"),
])
def test_a_rollout_config_that_would_not_read_what_its_pods_mount_is_named(overrides, field, profile):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        render.render("rollout", ROLLOUT, profile, overrides)


def test_a_profile_cannot_put_the_admin_key_where_serving_pods_read():
    with pytest.raises(ConfigError, match="openai_admin_key: must name a Secret other than openai_keys"):
        load_config(Profile, render.DEFAULT_PROFILE, ["secrets.openai_admin_key=rayline-openai-keys"])




def _mount(pod: str, secret: str, key: str):
    """An edit giving the pod at `pod` a Secret volume of `secret` (and its Ray container the mount)."""
    def edit(doc):
        spec = at(doc, pod)
        spec["volumes"].append({"name": "stolen", "secret": {"secretName": secret, "items": [{"key": key, "path": key}]}})
        for c in spec["containers"]:
            c.setdefault("volumeMounts", []).append({"name": "stolen", "mountPath": "/var/run/stolen", "readOnly": True})
        return f"{pod}.volumes[{len(spec['volumes']) - 1}]"
    return edit


def _env_ref(doc):
    env = at(doc, f"{HEAD}.containers[0].env")
    env.append({"name": "RAYLINE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": ADMIN, "key": "admin_key"}}})
    return f"{HEAD}.containers[0].env[{len(env) - 1}].valueFrom.secretKeyRef.name"


@pytest.mark.parametrize("fname, edit, secret", [
    ("serve-gpu.yaml", _mount(SERVE_WORKER, ADMIN, "admin_key"), ADMIN),
    ("train-tiny.yaml", _env_ref, ADMIN),
    ("rollout-tiny.yaml", _mount("spec.submitterPodTemplate.spec", ADMIN, "admin_key"), ADMIN),
    ("batch-eval-tiny.yaml", _mount(HEAD, HOOK, "secret"), HOOK),
], ids=["serving-pod-admin-key", "trainer-env-admin-key", "rollout-submitter-admin-key", "evaluator-webhook-secret"])
def test_a_render_giving_the_rollouts_secrets_to_another_pod_fails_at_that_field(fname, edit, secret, tmp_path, capsys):
    doc = copy.deepcopy(shipped(fname))
    assert validate_manifest(doc, project_root=ROOT) == []
    path = edit(doc)
    problems = [p for p in validate_manifest(doc, project_root=ROOT) if p.layer == "preflight"]
    assert [(p.path, f"reads Secret {secret!r}" in p.message) for p in problems] == [(path, True)], problems
    assert "only the Ray pods of role rollout may mount it" in problems[0].message
    # Through the CLI, as a user meets it: the file (the manifest) and the field on one line.
    bad = tmp_path / fname
    bad.write_text(yaml.safe_dump(doc))
    assert validate_cli([str(bad)]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith(f"{bad}: {path}: ") and secret in line for line in out.splitlines()), out


@pytest.mark.parametrize("name, keys, ok", [
    (ADMIN, {"admin_key": "YQ=="}, True), (ADMIN, {"key": "YQ=="}, False),
    (HOOK, {"secret": "YQ=="}, True), (HOOK, {"webhook_secret": "YQ=="}, False),
])
def test_the_rollouts_secrets_are_checked_by_shape(name, keys, ok):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "rayline"}, "data": keys}
    assert [p.path for p in validate_manifest(secret)] == ([] if ok else ["data"])
