"""The offline KubeRay validator: a realistic RayJob and RayService pass, and each broken variant is caught
at the right field path by the right layer. CRDs are parsed once per session (lru_cache in crd_schema)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipelines.validate import main as cli_main
from rayjobs.crd_schema import find_version
from rayjobs.preflight import accelerator_matches, gpu_fit
from rayjobs.validate import validate_files, validate_manifest

GIB = 1024**3
IMAGE = "rayproject/ray:2.60.0-py311"


# What rayline's preflight asks of every container and pod (rayjobs/pod_security.py), written out by hand.
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod(name: str, cpu: str, memory: str, gpus: int = 0, env: list | None = None) -> dict:
    limits = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {"spec": {
        "automountServiceAccountToken": False, "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [{
            "name": name, "image": IMAGE, "imagePullPolicy": "IfNotPresent",
            "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
            "env": copy.deepcopy(env or []), "securityContext": copy.deepcopy(CONTAINER_SECURITY),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"},
                             {"name": "ray-logs", "mountPath": "/tmp/ray"}],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
                    {"name": "tmp", "emptyDir": {}}, {"name": "ray-logs", "emptyDir": {}}],
    }}


HEAD = {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"}, "serviceType": "ClusterIP"}
SECRET_ENV = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]

RAYJOB = {
    "apiVersion": "ray.io/v1", "kind": "RayJob",
    "metadata": {"name": "prepare-data", "namespace": "rayline", "labels": {"app.kubernetes.io/part-of": "rayline"}},
    "spec": {
        "entrypoint": "python -m pipelines.prepare_data --config configs/data/sample.yaml",
        "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 600, "activeDeadlineSeconds": 7200, "backoffLimit": 1,
        "runtimeEnvYAML": "env_vars:\n  RAYLINE_STAGE: prepare_data\n",
        "rayClusterSpec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {**HEAD, "template": _pod("ray-head", "2", "8Gi", env=SECRET_ENV)},
            "workerGroupSpecs": [{"groupName": "cpu", "replicas": 2, "minReplicas": 1, "maxReplicas": 4,
                                  "rayStartParams": {}, "template": _pod("ray-worker", "4", "16Gi", env=SECRET_ENV)}],
        },
    },
}

SERVE_CONFIG = {
    "proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000},
    "applications": [{
        "name": "chat", "route_prefix": "/", "import_path": "serve.online.app:build_app",
        "runtime_env": {"env_vars": {"RAYLINE_MODEL": "tiny"}},
        "deployments": [{"name": "LLMServer", "num_replicas": 1,
                         "ray_actor_options": {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100"}}],
    }],
}
GPU_GROUP = {"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "rayStartParams": {},
             "template": _pod("ray-worker", "8", "64Gi", gpus=1, env=SECRET_ENV)}
GPU_GROUP["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
RAYSERVICE = {
    "apiVersion": "ray.io/v1", "kind": "RayService",
    "metadata": {"name": "chat", "namespace": "rayline", "annotations": {
        "rayline.io/model-params": "8B", "rayline.io/model-layers": "32", "rayline.io/model-kv-heads": "8",
        "rayline.io/model-head-dim": "128", "rayline.io/model-dtype-bytes": "2", "rayline.io/gpu-memory-gib": "80",
        "rayline.io/max-model-len": "8192"}},
    "spec": {
        "serveConfigV2": yaml.safe_dump(SERVE_CONFIG, sort_keys=False),
        "rayClusterConfig": {"rayVersion": "2.60.0", "enableInTreeAutoscaling": True,
                             "autoscalerOptions": {"securityContext": copy.deepcopy(CONTAINER_SECURITY)},
                             "headGroupSpec": {**HEAD, "template": _pod("ray-head", "2", "8Gi")},
                             "workerGroupSpecs": [GPU_GROUP]},
    },
}


@pytest.fixture(scope="module", autouse=True)
def crds():
    """Parse the two CRDs once for the module (find_version caches them per file)."""
    return {kind: find_version("ray.io/v1", kind) for kind in ("RayJob", "RayService")}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A stand-in project root with the modules the manifests name, so import checks do not depend on this repo."""
    root = tmp_path_factory.mktemp("project")
    for pkg, module, body in (("pipelines", "prepare_data", "def main(cfg): ...\n"),
                              ("serve/online", "app", "def build_app(args): ...\n")):
        (root / pkg).mkdir(parents=True)
        for level in (root / pkg, *(root / pkg).parents):
            if level == root:
                break
            (level / "__init__.py").write_text("")
        (root / pkg / f"{module}.py").write_text(body)
    return root


def _edit(doc: dict, fn) -> dict:
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


def _serve(doc: dict, fn) -> dict:
    """A RayService whose serveConfigV2 is SERVE_CONFIG edited by `fn`."""
    config = copy.deepcopy(SERVE_CONFIG)
    fn(config)
    return _edit(doc, lambda d: d["spec"].__setitem__("serveConfigV2", yaml.safe_dump(config)))


def _paths(problems, layer: str | None = None) -> set[str]:
    return {p.path for p in problems if layer is None or p.layer == layer}


def test_valid_manifests_have_no_problems(project):
    assert validate_manifest(RAYJOB, project_root=project) == []
    assert validate_manifest(RAYSERVICE, project_root=project) == []


@pytest.mark.parametrize("edit, path", [
    (lambda d: d["spec"].__setitem__("shutdownAfterJobFinish", True), "spec.shutdownAfterJobFinish"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolicyy", "Always"),
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].imagePullPolicyy"),
    (lambda d: d["metadata"].__setitem__("lables", {}), "metadata.lables"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", "two"), "spec.rayClusterSpec.workerGroupSpecs[0].replicas"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", True), "spec.rayClusterSpec.workerGroupSpecs[0].replicas"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("maxReplicas", 2**31), "spec.rayClusterSpec.workerGroupSpecs[0].maxReplicas"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0), "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("cpu", "4 cores"),
     "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__("ports", [{"containerPort": 8265}, {"containerPort": 8265}]),
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].ports[1]"),
    (lambda d: d["spec"].__setitem__("preRunningDeadlineSeconds", 0), "spec.preRunningDeadlineSeconds"),
    (lambda d: d["metadata"].__setitem__("name", "Prepare_Data"), "metadata.name"),
    (lambda d: d["metadata"]["labels"].__setitem__("team", "data eng"), "metadata.labels.team"),
])
def test_schema_rejects(project, edit, path):
    problems = validate_manifest(_edit(RAYJOB, edit), project_root=project)
    assert path in _paths(problems, "crd-schema"), problems


def test_misspelled_field_suggests_the_real_one(project):
    problems = validate_manifest(_edit(RAYJOB, lambda d: d["spec"].__setitem__("shutdownAfterJobFinish", True)), project_root=project)
    assert any('did you mean "shutdownAfterJobFinishes"' in p.message for p in problems)


def test_cel_rules_from_the_crd(project):
    legacy_and_rules = {"onSuccess": {"policy": "DeleteCluster"}, "onFailure": {"policy": "DeleteCluster"},
                        "deletionRules": [{"condition": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Failed"}, "policy": "DeleteCluster"}]}
    doc = _edit(RAYJOB, lambda d: d["spec"].update(deletionStrategy=legacy_and_rules, managedBy="someone-else"))
    problems = [p for p in validate_manifest(doc, project_root=project) if p.layer == "crd-schema"]
    messages = {p.path: p.message for p in problems}
    assert "cannot be used together" in messages["spec.deletionStrategy"]
    assert "cannot be used together" in messages["spec.deletionStrategy.deletionRules[0].condition"]
    assert "spec.managedBy" in messages
    ok = _edit(RAYJOB, lambda d: d["spec"].update(managedBy="kueue.x-k8s.io/multikueue", shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0,
                                                   deletionStrategy={"deletionRules": [{"condition": {"jobStatus": "SUCCEEDED"}, "policy": "DeleteCluster"}]}))
    assert validate_manifest(ok, project_root=project) == []


@pytest.mark.parametrize("edit, path", [
    (lambda d: d["spec"].__setitem__("ttlSecondsAfterFinished", -1), "spec.ttlSecondsAfterFinished"),
    (lambda d: d["spec"].__setitem__("shutdownAfterJobFinishes", False), "spec.ttlSecondsAfterFinished"),
    (lambda d: d["spec"].__setitem__("activeDeadlineSeconds", 0), "spec.activeDeadlineSeconds"),
    (lambda d: d["spec"].update(submissionMode="InteractiveMode", backoffLimit=2), "spec.backoffLimit"),
    (lambda d: d["spec"].update(clusterSelector={"ray.io/cluster": "shared"}, submissionMode="SidecarMode"), "spec.clusterSelector"),
    (lambda d: d["spec"].pop("rayClusterSpec"), "spec.rayClusterSpec"),
    (lambda d: d["spec"].__setitem__("runtimeEnvYAML", "pip: [torch"), "spec.runtimeEnvYAML"),
    (lambda d: d["metadata"].__setitem__("name", "a" * 48), "metadata.name"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(copy.deepcopy(d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0])),
     "spec.rayClusterSpec.workerGroupSpecs[1].groupName"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(minReplicas=5, maxReplicas=4, replicas=4), "spec.rayClusterSpec.workerGroupSpecs[0].minReplicas"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"].__setitem__("containers", []),
     "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].__setitem__("labels", "a=b"), "spec.rayClusterSpec.headGroupSpec.rayStartParams.labels"),
    (lambda d: d["spec"]["rayClusterSpec"].update(authOptions={"mode": "token"}, rayVersion="2.46.0"), "spec.rayClusterSpec.rayVersion"),
    (lambda d: d["spec"]["rayClusterSpec"].__setitem__("networkPolicy", {"mode": "DenyAll"}), "spec.rayClusterSpec.networkPolicy"),
])
def test_kuberay_operator_rules(project, edit, path):
    problems = validate_manifest(_edit(RAYJOB, edit), project_root=project)
    assert path in _paths(problems, "kuberay"), problems


def test_feature_gates_can_be_turned_on(project):
    doc = _edit(RAYJOB, lambda d: d["spec"]["rayClusterSpec"].__setitem__("networkPolicy", {"mode": "DenyAll"}))
    assert validate_manifest(doc, project_root=project, feature_gates={"RayClusterNetworkPolicy": True}) == []


@pytest.mark.parametrize("edit, path", [
    (lambda c: c["applications"][0].pop("import_path"), "spec.serveConfigV2.applications[0].import_path"),
    (lambda c: c["applications"][0].__setitem__("import_path", "serve.missing_app:build_app"), "spec.serveConfigV2.applications[0].import_path"),
    (lambda c: c["applications"][0].__setitem__("import_path", "serve.online.app:build_ap"), "spec.serveConfigV2.applications[0].import_path"),
    (lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replicas", "two"), "spec.serveConfigV2.applications[0].deployments[0].num_replicas"),
    (lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replica", 2), "spec.serveConfigV2.applications[0].deployments[0].num_replica"),
    (lambda c: c["applications"][0]["runtime_env"].__setitem__("piip", ["x"]), "spec.serveConfigV2.applications[0].runtime_env.piip"),
])
def test_serve_config_through_ray_schema(project, edit, path):
    problems = validate_manifest(_serve(RAYSERVICE, edit), project_root=project)
    assert path in _paths(problems, "ray"), problems


def test_serve_config_that_is_not_yaml(project):
    doc = _edit(RAYSERVICE, lambda d: d["spec"].__setitem__("serveConfigV2", "applications:\n  - name: [chat\n"))
    problems = validate_manifest(doc, project_root=project)
    assert any(p.path == "spec.serveConfigV2" and "not valid YAML" in p.message for p in problems), problems


def test_entrypoint_module_must_exist(project):
    doc = _edit(RAYJOB, lambda d: d["spec"].__setitem__("entrypoint", "python -m pipelines.prepare_dat --config x.yaml"))
    assert "spec.entrypoint" in _paths(validate_manifest(doc, project_root=project), "ray")


def test_inline_secrets_are_flagged_without_echoing_them(project):
    leak = "hf_verysecretvalue"
    doc = _edit(RAYJOB, lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"].extend([
        {"name": "AWS_ACCESS_KEY_ID", "value": leak}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]))
    doc["spec"]["runtimeEnvYAML"] = f"env_vars:\n  MLFLOW_TRACKING_PASSWORD: {leak}\n"
    problems = [p for p in validate_manifest(doc, project_root=project) if p.layer == "preflight"]
    assert _paths(problems) == {"spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].env[1].value",
                                "spec.runtimeEnvYAML.env_vars.MLFLOW_TRACKING_PASSWORD"}
    assert not any(leak in p.message for p in problems)


def test_strict_pack_bundles_larger_than_any_pod(project):
    def two_gpu_strict_pack(c):
        c["applications"][0]["deployments"][0].update(placement_group_bundles=[{"CPU": 1, "GPU": 1}, {"GPU": 1}], placement_group_strategy="STRICT_PACK")
    problems = validate_manifest(_serve(RAYSERVICE, two_gpu_strict_pack), project_root=project)
    assert "spec.serveConfigV2.applications[0].deployments[0].placement_group_bundles" in _paths(problems, "preflight"), problems
    spread = _serve(RAYSERVICE, lambda c: c["applications"][0]["deployments"][0].update(placement_group_bundles=[{"GPU": 1}] * 2, placement_group_strategy="PACK"))
    assert validate_manifest(spread, project_root=project) == []


def test_accelerator_type_without_a_matching_node_selector(project):
    doc = _edit(RAYSERVICE, lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"].pop("nodeSelector"))
    problems = validate_manifest(doc, project_root=project)
    assert "spec.serveConfigV2.applications[0].deployments[0].ray_actor_options.accelerator_type" in _paths(problems, "preflight"), problems
    assert accelerator_matches("A100-80G", "nvidia-a100-80gb") and not accelerator_matches("L4", "nvidia-l40s")


def test_oversized_model(project):
    doc = _edit(RAYSERVICE, lambda d: d["metadata"]["annotations"].update({
        "rayline.io/model-params": "70B", "rayline.io/model-layers": "80", "rayline.io/model-kv-heads": "8"}))
    problems = [p for p in validate_manifest(doc, project_root=project) if p.layer == "preflight"]
    assert _paths(problems) == {"metadata.annotations[rayline.io/model-params]"}
    assert "weights alone do not fit" in problems[0].message


def test_gpu_fit_arithmetic():
    ok, why = gpu_fit(70_000_000_000, 80, 8, 128, 2, 8192, 256, 1, 80 * GIB, 0.9)
    assert not ok and "130.4 GiB" in why
    ok, _ = gpu_fit(70_000_000_000, 80, 8, 128, 2, 8192, 256, 4, 80 * GIB, 0.9)
    assert ok
    # 8B fp16 fits its weights on a 24 GiB L4, but 128k tokens of KV (16 GiB) do not.
    ok, why = gpu_fit(8_000_000_000, 32, 8, 128, 2, 131072, 16, 1, 24 * GIB, 0.9)
    assert not ok and "max_model_len" in why
    with pytest.raises(ValueError):
        gpu_fit(8_000_000_000, 32, 8, 128, 2, 8192, 16, 0, 24 * GIB, 0.9)


def test_exposed_head_and_clamped_replicas(project):
    doc = _edit(RAYJOB, lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"].update(serviceType="LoadBalancer", enableIngress=True))
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = 9
    assert _paths(validate_manifest(doc, project_root=project), "preflight") == {
        "spec.rayClusterSpec.headGroupSpec.serviceType", "spec.rayClusterSpec.headGroupSpec.enableIngress",
        "spec.rayClusterSpec.workerGroupSpecs[0].replicas"}


def test_files_and_cli(project, tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump_all([RAYJOB, RAYSERVICE]))
    bad.write_text("apiVersion: ray.io/v1\nkind: RayJob\nkind: RayJob\n")
    results = validate_files([good, bad], project_root=project)
    assert results[f"{good}#1"] == [] and results[f"{good}#2"] == []
    assert "duplicate key 'kind'" in results[str(bad)][0].message
    assert cli_main([str(good), "--project-root", str(project)]) == 0
    assert f"{good}#1: validated (RayJob prepare-data): 3 layers + preflight passed" in capsys.readouterr().out
    assert cli_main([str(bad), str(good), "--project-root", str(project)]) == 1
