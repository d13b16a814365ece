"""Hardening of the renders (issue #48, section 5): every shipped pod restricted under its role's ServiceAccount with its
role's credentials only, images by digest, the namespace's objects; and a render with one item taken away fails
validation at that manifest's field."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from core.config import ConfigError
from pipelines.validate import main as validate_cli
from rayjobs import render, stages
from tests.rayjobs.shipped_pods import HEAD, WORKER, SERVE_WORKER, at, pods, shipped
from rayjobs.cluster_profile import Profile
from rayjobs.credentials import MLFLOW_DIR, OPENAI_DIR
from rayjobs.roles import ROLES, get_role
from rayjobs.validate import validate_manifest

ROOT = stages.PROJECT_ROOT
RAY_KINDS = ("RayJob", "RayService")


@pytest.fixture(scope="module")
def profile():
    return render.load_profile(None)




def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_refs(container: dict) -> set[str]:
    return {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if "valueFrom" in e}


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_every_shipped_pod_is_restricted_with_writable_dirs_only_where_ray_writes(fname):
    for name, pod in pods(shipped(fname)):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}, (fname, name)
            writable = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty_dirs}
            assert {"/tmp", "/tmp/ray", _env(c)["HOME"]["value"]} <= writable, (fname, name)


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_each_stage_runs_as_its_role_with_a_token_only_where_the_kubernetes_api_is_called(fname):
    stage = render.SHIPPED[fname][0]
    role = get_role(stages.get_stage(stage).role)
    assert role.service_account == {"data": "rayline-trainer", "train": "rayline-trainer", "tune": "rayline-trainer",
                                    "batch_infer": "rayline-evaluator", "rollout": "rayline-rollout",
                                    "serve": "rayline-serving"}[stage]
    for name, pod in pods(shipped(fname)):
        assert pod["spec"]["serviceAccountName"] == role.service_account
        # The rollout's driver runs on its head and patches the RayService; nothing else talks to the API server.
        assert pod["spec"]["automountServiceAccountToken"] is (stage == "rollout" and name == "head"), (fname, name)
        for c in pod["spec"]["containers"]:
            if name != "submitter":
                assert _env(c)["RAYLINE_ROLE"]["value"] == role.name


def test_service_accounts_one_per_role_and_only_the_rollouts_hands_out_tokens():
    accounts = list(yaml.safe_load_all((ROOT / "rayjobs/rendered/rbac/service-accounts.yaml").read_text()))
    assert {a["metadata"]["name"]: a["automountServiceAccountToken"] for a in accounts} == {
        "rayline-trainer": False, "rayline-evaluator": False, "rayline-rollout": True, "rayline-serving": False}


@pytest.mark.parametrize("fname", sorted(render.SHIPPED))
def test_credentials_per_role_files_not_env_and_serving_reads_only(fname, profile):
    stage = render.SHIPPED[fname][0]
    role = get_role(stages.get_stage(stage).role)
    for name, pod in pods(shipped(fname)):
        if name == "submitter":  # runs `ray job submit` only: KubeRay gives it the Ray token, nothing else
            assert all(not _secret_refs(c) for c in pod["spec"]["containers"])
            assert not any("secret" in v for v in pod["spec"]["volumes"])
            continue
        (c,) = pod["spec"]["containers"]
        env, volumes = _env(c), {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert not {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"} & env.keys()
        assert env["RAYLINE_MLFLOW_CREDENTIALS"]["value"] == MLFLOW_DIR and mounts[MLFLOW_DIR]["readOnly"] is True
        login = volumes[mounts[MLFLOW_DIR]["name"]]["secret"]
        assert login["secretName"] == f"rayline-mlflow-{role.name}"
        assert [i["key"] for i in login["items"]] == ["username", "password"]  # kubernetes.io/basic-auth's keys
        store = {profile.secrets.s3_read_only} if stage == "serve" else {profile.secrets.s3}
        assert _secret_refs(c) == store | {profile.secrets.hf}, (fname, name)
        if stage == "serve":
            assert env["RAYLINE_API_KEYS_FILE"]["value"] == f"{OPENAI_DIR}/keys.json"
            keys = volumes[mounts[OPENAI_DIR]["name"]]["secret"]
            assert keys["secretName"] == "rayline-openai-keys" and keys["items"] == [{"key": "keys.json", "path": "keys.json"}]
        else:
            assert "RAYLINE_API_KEYS_FILE" not in env and OPENAI_DIR not in mounts


def test_images_by_digest_when_the_profile_gives_one(profile):
    digest = "sha256:" + "ab" * 32
    pinned = dataclasses.replace(profile, image_digest=digest)
    doc = render.render("train", str(ROOT / "configs/train/tiny.yaml"), pinned)
    images = {c["image"] for _, pod in pods(doc) for c in pod["spec"]["containers"]}
    assert images == {f"{profile.image}@{digest}"}
    assert validate_manifest(doc, project_root=ROOT) == []
    with pytest.raises(ConfigError, match=r"image_digest: must be sha256:<64 lowercase hex digits>, got 'sha256:abc'"):
        Profile(image_digest="sha256:abc")


def test_an_autoscaling_head_gives_the_token_to_the_autoscaler_container_only(profile):
    doc = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), profile,
                        ["autoscaling.min_replicas=1", "autoscaling.max_replicas=3"])
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]
    assert head["spec"]["automountServiceAccountToken"] is False
    assert head["metadata"]["labels"]["rayline.io/kube-api"] == "true"  # may reach the API server
    token = next(v for v in head["spec"]["volumes"] if v["name"] == "kube-api-token")
    assert [next(iter(s)) for s in token["projected"]["sources"]] == ["serviceAccountToken", "configMap", "downwardAPI"]
    options = cluster["autoscalerOptions"]
    assert {"name": "kube-api-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True} in options["volumeMounts"]
    assert options["securityContext"]["readOnlyRootFilesystem"] is True
    assert all(m["name"] != "kube-api-token" for m in head["spec"]["containers"][0]["volumeMounts"])
    assert validate_manifest(doc, project_root=ROOT) == []


def test_the_namespace_enforces_pod_security_restricted():
    (ns,) = yaml.safe_load_all((ROOT / "rayjobs/rendered/namespace/namespace.yaml").read_text())
    assert {k: v for k, v in ns["metadata"]["labels"].items() if k.startswith("pod-security")} == {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/audit": "restricted",
        "pod-security.kubernetes.io/warn": "restricted"}


@pytest.mark.parametrize("override, field", [
    ("secrets.s3_read_only=rayline-s3", "s3_read_only"),
    ("network.mlflow.ports=[80]", "mlflow_tracking_uri"),
    ("network.kube_api.namespace=kube-system", "network.kube_api.cidrs"),
    ("network.object_store.cidrs=[10.0.0.0/33]", "network.object_store.cidrs"),
    ("home_dir=/home/ray", "home_dir"),
])
def test_a_profile_that_would_weaken_or_break_the_renders_is_named(override, field):
    with pytest.raises(ConfigError, match=field):
        render.load_config(Profile, render.DEFAULT_PROFILE, [override])




def _env_index(doc: dict, pod: str, name: str) -> int:
    return next(i for i, e in enumerate(at(doc, f"{pod}.containers[0].env")) if e["name"] == name)


def _serve_rw(doc):
    i = _env_index(doc, SERVE_WORKER, "AWS_SECRET_ACCESS_KEY")
    at(doc, f"{SERVE_WORKER}.containers[0].env")[i]["valueFrom"]["secretKeyRef"]["name"] = "rayline-s3"
    return f"{SERVE_WORKER}.containers[0].env[{i}].valueFrom.secretKeyRef.name", "read/write object-store"


def _mlflow_env(doc):
    env = at(doc, f"{HEAD}.containers[0].env")
    env.append({"name": "MLFLOW_TRACKING_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "rayline-mlflow", "key": "p"}}})
    return f"{HEAD}.containers[0].env[{len(env) - 1}]", "MLflow logins are files"


def _literal_secret(doc):
    env = at(doc, f"{WORKER}.containers[0].env")
    env.append({"name": "HF_TOKEN", "value": "hf_not_a_real_token"})
    return f"{WORKER}.containers[0].env[{len(env) - 1}].value", "use valueFrom.secretKeyRef"


def _drop(path: str, message: str):
    def edit(doc):
        parent, key = path.rsplit(".", 1)
        del at(doc, parent)[key]
        return path if "securityContext" in path or "automount" in path else parent, message
    return edit


def _ray_tmp(doc):
    mounts = at(doc, f"{WORKER}.containers[0].volumeMounts")
    mounts[:] = [m for m in mounts if m["mountPath"] != "/tmp/ray"]
    return f"{WORKER}.containers[0].volumeMounts", "no writable /tmp/ray"


@pytest.mark.parametrize("fname, edit", [
    ("train-tiny.yaml", _drop(f"{HEAD}.containers[0].securityContext.readOnlyRootFilesystem", "must be true")),
    ("train-tiny.yaml", _drop(f"{WORKER}.containers[0].securityContext.allowPrivilegeEscalation", "must be false")),
    ("train-tiny.yaml", _drop(f"{WORKER}.containers[0].securityContext.capabilities", "drop ALL")),
    ("data-sample.yaml", _drop("spec.submitterPodTemplate.spec.containers[0].securityContext", "must be false")),
    ("batch-eval-tiny.yaml", _drop(f"{HEAD}.securityContext", "Pod Security restricted")),
    ("train-tiny.yaml", _drop(f"{WORKER}.automountServiceAccountToken", "does not call the Kubernetes API")),
    ("train-tiny.yaml", _ray_tmp),
    ("serve-gpu.yaml", _serve_rw),
    ("tune-tiny.yaml", _mlflow_env),
    ("train-tiny.yaml", _literal_secret),
], ids=["read-only-root", "privilege-escalation", "capabilities", "submitter", "pod-security-context",
        "token-automount", "ray-tmp", "serving-rw-store", "mlflow-env", "literal-secret"])
def test_a_render_with_one_hardening_item_removed_fails_at_that_field(fname, edit, tmp_path, capsys):
    doc = copy.deepcopy(shipped(fname))
    path, message = edit(doc)
    problems = [p for p in validate_manifest(doc, project_root=ROOT) if p.layer == "preflight"]
    assert any(p.path.startswith(path) and message in p.message for p in problems), problems
    # Through the CLI, as a user meets it: the file (the manifest) and the field on one line.
    bad = tmp_path / fname
    bad.write_text(yaml.safe_dump(doc))
    assert validate_cli([str(bad)]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith(f"{bad}: {path}") and message in line for line in out.splitlines()), out
    assert "hf_not_a_real_token" not in out


def test_an_autoscaler_without_a_security_context_fails(profile):
    doc = render.render("serve", str(ROOT / "configs/serve/tiny_cpu.yaml"), profile,
                        ["autoscaling.min_replicas=1", "autoscaling.max_replicas=3"])
    del doc["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    paths = {p.path for p in validate_manifest(doc, project_root=ROOT)}
    assert "spec.rayClusterConfig.autoscalerOptions.securityContext.allowPrivilegeEscalation" in paths


@pytest.mark.parametrize("fname, edit, path, message", [
    ("rbac/service-accounts.yaml", lambda d: d.pop("automountServiceAccountToken"), "automountServiceAccountToken",
     "do not call the Kubernetes API"),
    ("namespace/namespace.yaml", lambda d: d["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce"),
     "metadata.labels.pod-security.kubernetes.io/enforce", "must be 'restricted'"),
])
def test_namespace_objects_without_their_hardening_fail(fname, edit, path, message):
    doc = copy.deepcopy(next(yaml.safe_load_all((ROOT / "rayjobs" / "rendered" / fname).read_text())))
    assert validate_manifest(doc) == []
    edit(doc)
    assert [(p.path, message in p.message) for p in validate_manifest(doc)] == [(path, True)]


def test_rayline_secrets_are_checked_by_shape_never_by_value():
    login = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/basic-auth",
             "metadata": {"name": "rayline-mlflow-trainer", "namespace": "rayline"},
             "stringData": {"username": "trainer", "password": "s3cr3t-value"}}
    assert validate_manifest(login) == []
    opaque = {**login, "type": "Opaque", "stringData": {"user": "trainer", "pass": "s3cr3t-value"}}
    problems = validate_manifest(opaque)
    assert [p.path for p in problems] == ["type", "data"] and "s3cr3t-value" not in str(problems)
    keys = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rayline-openai-keys"}, "data": {"keys": "e30="}}
    assert [p.path for p in validate_manifest(keys)] == ["data"]
    assert [p.path for p in validate_manifest({**login, "strigData": {}})] == ["strigData"]


def test_roles_cover_every_stage():
    assert {s.role for s in stages.STAGES.values()} == set(ROLES)
