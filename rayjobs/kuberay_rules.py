"""Layer 2: the checks the KubeRay operator itself runs on RayCluster / RayJob / RayService / RayCronJob objects.

Ported from KubeRay v1.7.0, `ray-operator/controllers/ray/utils/validation.go` (ValidateRayClusterMetadata,
ValidateRayClusterSpec with validateRayGroupResources / validateRayGroupLabels / validateWorkerGroupIdleTimeout /
validateWorkerGroupPriority / validateGcsFaultToleranceBackend / validateNetworkPolicy / validateTLSOptions,
ValidateRayClusterUpgradeOptions, ValidateRayJobMetadata, ValidateRayJobSpec with validateDeletionConfiguration /
validateLegacyDeletionPolicies / validateDeletionRules / validateTTLConsistency, ValidateRayServiceMetadata,
validateInitializingTimeout, ValidateRayServiceSpec, ValidateClusterUpgradeOptions, ValidateRayCronJobSpec), plus
the RayCluster admission webhook `ray-operator/pkg/webhooks/v1/raycluster_webhook.go` (name regex, unique worker
group names), with constants from `utils/constant.go` and feature-gate defaults from `pkg/features/features.go`.
One addition: an unknown `submissionMode` (the CRD has no enum; the modes are `apis/ray/v1/rayjob_types.go`'s).

The operator stops at the first error; here every rule runs so one pass reports them all. Rules behind an
operator feature gate use v1.7.0's defaults (`DEFAULT_FEATURE_GATES`); pass `feature_gates` to match your install.
Not ported (need the operator's environment or constants not reproduced here): the rocksdb backend's managed
env/volume names, the TLS volume-mount name/path and the history-server collector env rules.
Input is the manifest with CRD defaults applied (`crd_schema.with_defaults`), as the operator sees it.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import yaml

from rayjobs.crd_schema import Problem, child_path
from rayjobs.k8s_names import dns1035_label_errors, dns1123_label_errors, label_value_errors, qualified_name_errors

LAYER = "kuberay"
DEFAULT_FEATURE_GATES = {  # pkg/features/features.go, v1.7.0
    "RayJobDeletionPolicy": True, "RayServiceIncrementalUpgrade": True, "RayCronJob": False,
    "RayClusterNetworkPolicy": False, "GCSFaultToleranceEmbeddedStorage": False, "RayClusterMTLS": False,
    "RayClusterHistoryServer": False,
}
MAX_RAYCLUSTER_NAME = 53  # 63 - len("-serve-svc")
MAX_RAYJOB_NAME = MAX_RAYSERVICE_NAME = MAX_RAYCLUSTER_NAME - 6  # the cluster name appends "-xxxxx"
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")  # apis/ray/v1/rayjob_types.go
_WEBHOOK_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
Add = Callable[[str, str], None]


def _get(obj: Any, *keys: str | int) -> Any:
    """Nested lookup that returns None instead of raising on a missing key or a wrongly typed value."""
    for k in keys:
        if isinstance(k, int):
            obj = obj[k] if isinstance(obj, list) and len(obj) > k else None
        else:
            obj = obj.get(k) if isinstance(obj, dict) else None
        if obj is None:
            return None
    return obj


def _map(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _env(container: Any) -> dict[str, dict]:
    return {e["name"]: e for e in _list(_get(container, "env")) if isinstance(e, dict) and isinstance(e.get("name"), str)}


def _version(text: Any) -> tuple[int, ...] | None:
    """k8s.io/apimachinery version.ParseGeneric: `[v]MAJOR.MINOR[.PATCH...]`, None if unparsable."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)+)([-+].*)?", str(text or ""))
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _autoscaling(spec: Any) -> bool:
    return _get(spec, "enableInTreeAutoscaling") is True


def _autoscaler_v2(spec: Any) -> bool:
    return _get(spec, "autoscalerOptions", "version") == "v2"


def _name_rules(meta: dict, kind: str, limit: int, add: Add) -> None:
    name = meta.get("name")
    if not isinstance(name, str):
        return
    if len(name) > limit:
        add("metadata.name", f"{kind} name should be no more than {limit} characters (is {len(name)}): KubeRay derives longer names from it")
    for e in dns1035_label_errors(name):
        add("metadata.name", f"{kind} name should be a valid DNS1035 label: {e}")


def _group_rules(group: dict, name: str, path: str, add: Add) -> None:
    params = _map(group.get("rayStartParams"))
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
        add(child_path(path, "resources"), f"resource fields should not be set in both rayStartParams and Resources for {name} group; please use only one")
    if "labels" in params:
        add(child_path(path, "rayStartParams") + ".labels", f"rayStartParams['labels'] is not supported for {name} group; please use the top-level Labels field instead")
    for key, val in _map(group.get("labels")).items():
        for e in qualified_name_errors(str(key)):
            add(child_path(child_path(path, "labels"), str(key)), f"invalid label key for {name} group: {key!r}, error: {e}")
        for e in label_value_errors(str(val)):
            add(child_path(child_path(path, "labels"), str(key)), f"invalid label value for key {key!r} in {name} group: {val!r}, error: {e}")


def check_cluster_spec(spec: Any, annotations: dict, base: str, gates: dict[str, bool], add: Add) -> None:
    """ValidateRayClusterSpec (+ the webhook's unique worker group names) for the cluster spec at `base`."""
    if not isinstance(spec, dict):
        return
    head = _map(spec.get("headGroupSpec"))
    head_path = f"{base}.headGroupSpec"
    head_c = _get(head, "template", "spec", "containers", 0) or {}
    head_env = _env(head_c)
    if not _get(head, "template", "spec", "containers"):
        add(f"{head_path}.template.spec.containers", "headGroupSpec should have at least one container")
    _group_rules(head, "Head", head_path, add)
    autoscaling = _autoscaling(spec)
    v2_env = _get(head_env, "RAY_enable_autoscaler_v2", "value") in ("1", "true")
    seen: dict[str, int] = {}
    for i, group in enumerate(_list(spec.get("workerGroupSpecs"))):
        if not isinstance(group, dict):
            continue
        path, name = f"{base}.workerGroupSpecs[{i}]", str(group.get("groupName"))
        if name in seen:  # raycluster_webhook.go; applies to the RayCluster a RayJob/RayService creates too
            add(f"{path}.groupName", f"worker group names must be unique ({name!r} is also workerGroupSpecs[{seen[name]}])")
        seen.setdefault(name, i)
        if not _get(group, "template", "spec", "containers"):
            add(f"{path}.template.spec.containers", "workerGroupSpec should have at least one container")
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            add(path, f"worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled")
        for key, val in (("minReplicas", lo), ("maxReplicas", hi)):
            if isinstance(val, int) and val < 0:
                add(f"{path}.{key}", f"worker group {name} has negative {key} {val}")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            add(f"{path}.minReplicas", f"worker group {name} has minReplicas {lo} greater than maxReplicas {hi}")
        _group_rules(group, name, path, add)
        idle = group.get("idleTimeoutSeconds")
        if isinstance(idle, int) and idle < 0:
            add(f"{path}.idleTimeoutSeconds", f"worker group {name}: idleTimeoutSeconds must be non-negative, got {idle}")
        elif idle is not None and not (_autoscaler_v2(spec) or v2_env):
            add(f"{path}.idleTimeoutSeconds", f"worker group {name}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled; set .autoscalerOptions.version to 'v2'")
        priority = group.get("priority")
        if priority:
            ray_version = _version(spec.get("rayVersion"))
            if ray_version is None or ray_version < (2, 56, 0):
                add(f"{path}.priority", f"worker group {name}: priority is set, but rayVersion {spec.get('rayVersion')!r} is not 2.56.0 or later")
            elif not (_autoscaler_v2(spec) or v2_env):
                add(f"{path}.priority", f"worker group {name}: priority is set to {priority}, but autoscaler v2 is not enabled")
        if group.get("suspend") is True and not gates["RayJobDeletionPolicy"]:
            add(f"{path}.suspend", f"worker group {name} can be suspended only when the RayJobDeletionPolicy feature gate is enabled")
        if group.get("suspend") is True and autoscaling:
            add(f"{path}.suspend", f"worker group {name} cannot be suspended with Autoscaler enabled")
        restart = _get(group, "template", "spec", "restartPolicy")
        if autoscaling and _autoscaler_v2(spec) and restart not in (None, "", "Never"):
            add(f"{path}.template.spec.restartPolicy", f"restartPolicy for worker group {name} should be Never or unset when using autoscaler V2")

    ft_options = spec.get("gcsFaultToleranceOptions")
    ft_annotation = str(annotations.get("ray.io/ft-enabled", ""))
    head_env_path = f"{head_path}.template.spec.containers[0].env"
    if ft_annotation and ft_options is not None:
        add(f"{base}.gcsFaultToleranceOptions", "ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set. Please use only GcsFaultToleranceOptions")
    if ft_annotation.lower() != "true" and ft_options is None and "RAY_REDIS_ADDRESS" in head_env:
        add(head_env_path, "RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance, but GcsFaultToleranceOptions is not set")
    if isinstance(ft_options, dict):
        _gcs_ft_rules(ft_options, head, head_env, annotations, f"{base}.gcsFaultToleranceOptions", gates, add)
    if _get(head, "rayStartParams", "redis-username") or "REDIS_USERNAME" in head_env:
        add(head_path, "cannot set redis username in rayStartParams or environment variables - use GcsFaultToleranceOptions.RedisUsername instead")
    if not autoscaling and v2_env:
        add(head_env_path, f"RAY_enable_autoscaler_v2 cannot be set to {_get(head_env, 'RAY_enable_autoscaler_v2', 'value')!r} when enableInTreeAutoscaling is false")
    if autoscaling and _get(spec, "autoscalerOptions", "version") is not None and "RAY_enable_autoscaler_v2" in head_env:
        add(f"{base}.autoscalerOptions.version", "both .autoscalerOptions.version and head Pod env var RAY_enable_autoscaler_v2 are set, please only use the former")
    if autoscaling and _autoscaler_v2(spec) and _get(head, "template", "spec", "restartPolicy") not in (None, "", "Never"):
        add(f"{head_path}.template.spec.restartPolicy", "restartPolicy for head Pod should be Never or unset when using autoscaler V2")
    idle = _get(spec, "autoscalerOptions", "idleTimeoutSeconds")
    if isinstance(idle, int) and idle < 0:
        add(f"{base}.autoscalerOptions.idleTimeoutSeconds", f"autoscalerOptions.idleTimeoutSeconds must be non-negative, got {idle}")
    if "KUBERAY_GEN_AUTOSCALER_START_CMD" in _env(spec.get("autoscalerOptions")):
        add(f"{base}.autoscalerOptions.env", "autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD: it is managed by KubeRay")
    history = spec.get("historyServerOptions")
    if history is not None:
        if not gates["RayClusterHistoryServer"]:
            add(f"{base}.historyServerOptions", "RayClusterHistoryServer feature gate is not enabled")
        if _get(history, "collectorOptions") is None:
            add(f"{base}.historyServerOptions.collectorOptions", "historyServerOptions.collectorOptions must be set")
        elif not _get(history, "collectorOptions", "image"):
            add(f"{base}.historyServerOptions.collectorOptions.image", "historyServerOptions.collectorOptions.image must be set")
    _auth_rules(spec, base, add)
    if spec.get("networkPolicy") is not None:
        if not gates["RayClusterNetworkPolicy"]:
            add(f"{base}.networkPolicy", "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled")
        _network_policy_rules(spec, f"{base}.networkPolicy", add)
    if spec.get("tlsOptions") is not None:
        if not gates["RayClusterMTLS"]:
            add(f"{base}.tlsOptions", "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled")
        if _get(spec, "tlsOptions", "enabled") is True:
            targets = [(head_c, head_env_path)] + [
                (_get(g, "template", "spec", "containers", 0), f"{base}.workerGroupSpecs[{i}].template.spec.containers[0].env")
                for i, g in enumerate(_list(spec.get("workerGroupSpecs")))
            ] + [(spec.get("autoscalerOptions"), f"{base}.autoscalerOptions.env")]
            for container, env_path in targets:
                for var in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
                    if var in _env(container):
                        add(env_path, f"cannot set {var} when tlsOptions is set - the operator manages TLS configuration automatically")


def _gcs_ft_rules(ft: dict, head: dict, head_env: dict, annotations: dict, path: str, gates: dict[str, bool], add: Add) -> None:
    if _get(head, "rayStartParams", "redis-password"):
        add(path, "cannot set `redis-password` in rayStartParams when GcsFaultToleranceOptions is enabled - use GcsFaultToleranceOptions.RedisPassword instead")
    for var, field in (("REDIS_PASSWORD", "RedisPassword"), ("RAY_REDIS_ADDRESS", "RedisAddress")):
        if var in head_env:
            add(path, f"cannot set `{var}` env var in head Pod when GcsFaultToleranceOptions is enabled - use GcsFaultToleranceOptions.{field} instead")
    if annotations.get("ray.io/external-storage-namespace"):
        add(path, "cannot set `ray.io/external-storage-namespace` annotation when GcsFaultToleranceOptions is enabled - use GcsFaultToleranceOptions.ExternalStorageNamespace instead")
    if ft.get("backend") == "rocksdb":
        if not gates["GCSFaultToleranceEmbeddedStorage"]:
            add(f"{path}.backend", "the embedded RocksDB backend requires the GCSFaultToleranceEmbeddedStorage feature gate to be enabled")
        for field in ("redisAddress", "redisUsername", "redisPassword", "externalStorageNamespace"):
            if ft.get(field) not in (None, ""):
                add(f"{path}.{field}", f"cannot set GcsFaultToleranceOptions.{field} when backend is 'rocksdb'")
        storage = ft.get("storage") or {}
        if storage.get("claimName") and any(storage.get(k) for k in ("size", "storageClassName", "accessModes")):
            add(f"{path}.storage.claimName", "GcsFaultToleranceOptions.Storage.ClaimName is mutually exclusive with size, storageClassName, and accessModes")
    elif ft.get("storage") is not None:
        add(f"{path}.storage", "cannot set GcsFaultToleranceOptions.Storage when backend is 'redis' - it only applies to the 'rocksdb' backend")


def _auth_rules(spec: dict, base: str, add: Add) -> None:
    auth = spec.get("authOptions") or {}
    k8s_auth = auth.get("enableK8sTokenAuth") is True
    if auth.get("mode") != "token":
        if k8s_auth:
            add(f"{base}.authOptions.enableK8sTokenAuth", "authOptions.enableK8sTokenAuth is enabled but authOptions.mode not set to 'token'")
        return
    ray_version = _version(spec.get("rayVersion"))
    if ray_version is None or ray_version < (2, 52, 0):
        add(f"{base}.rayVersion", f"authOptions.mode is 'token', which needs rayVersion 2.52.0 or later (got {spec.get('rayVersion')!r})")
    elif k8s_auth and ray_version < (2, 55, 0):
        add(f"{base}.rayVersion", f"authOptions.enableK8sTokenAuth is enabled but minimum Ray version is 2.55.0, got {spec.get('rayVersion')}")
    if k8s_auth and auth.get("secretName"):
        add(f"{base}.authOptions.secretName", "authOptions.enableK8sTokenAuth is enabled and authOptions.secretName is also set")


def _network_policy_rules(spec: dict, path: str, add: Add) -> None:
    np = spec.get("networkPolicy") or {}
    mode = np.get("mode") or "DenyAll"
    entries = [(np.get("head"), f"{path}.head"), (np.get("worker"), f"{path}.worker")]
    entries += [(wg, f"{path}.workerGroups[{i}]") for i, wg in enumerate(np.get("workerGroups") or [])]
    for entry, entry_path in entries:
        if mode == "DenyAllEgress" and _get(entry, "ingressRules"):
            add(f"{entry_path}.ingressRules", f"ingressRules cannot be set when mode is {mode!r} (ingress is not restricted)")
        if mode == "DenyAllIngress" and _get(entry, "egressRules"):
            add(f"{entry_path}.egressRules", f"egressRules cannot be set when mode is {mode!r} (egress is not restricted)")
    names = set()
    for i, group in enumerate(_list(spec.get("workerGroupSpecs"))):
        name = str(_get(group, "groupName") or "")
        names.add(name)
        for e in dns1123_label_errors(name):
            add(f"{path.rsplit('.', 1)[0]}.workerGroupSpecs[{i}].groupName", f"worker group name {name!r} must be a valid DNS1123 label when networkPolicy is enabled: {e}")
    for i, wg in enumerate(np.get("workerGroups") or []):
        if _get(wg, "groupName") not in names:
            add(f"{path}.workerGroups[{i}].groupName", f"networkPolicy.workerGroups[{_get(wg, 'groupName')!r}] does not match any group name in workerGroupSpecs")


def check_rayjob_spec(spec: dict, annotations: dict, base: str, gates: dict[str, bool], add: Add) -> None:
    """ValidateRayJobSpec for the RayJob spec at `base` (`spec`, or `spec.jobTemplate` of a RayCronJob)."""
    shutdown, ttl = spec.get("shutdownAfterJobFinishes") is True, spec.get("ttlSecondsAfterFinished") or 0
    selector, mode, backoff = spec.get("clusterSelector") or {}, spec.get("submissionMode") or "K8sJobMode", spec.get("backoffLimit")
    cluster = spec.get("rayClusterSpec")
    if spec.get("suspend") is True and not shutdown:
        add(f"{base}.suspend", "a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended")
    if isinstance(ttl, int) and ttl < 0:
        add(f"{base}.ttlSecondsAfterFinished", "TTLSecondsAfterFinished must be a non-negative integer")
    if not shutdown and isinstance(ttl, int) and ttl > 0:
        add(f"{base}.ttlSecondsAfterFinished", "a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished; set shutdownAfterJobFinishes: true")
    if isinstance(spec.get("deletionStrategy"), dict):
        _deletion_rules(spec, f"{base}.deletionStrategy", gates, add)
    if spec.get("suspend") is True and selector:
        add(f"{base}.suspend", "the ClusterSelector mode doesn't support the suspend operation")
    if cluster is None and not selector:
        add(f"{base}.rayClusterSpec", "one of RayClusterSpec or ClusterSelector must be set")
    if selector:
        if not selector.get("ray.io/cluster"):
            add(f"{base}.clusterSelector", "cluster name in ClusterSelector (key ray.io/cluster) should not be empty")
        if mode == "SidecarMode":
            add(f"{base}.clusterSelector", "ClusterSelector is not supported in SidecarMode")
        if isinstance(backoff, int) and backoff > 0:
            add(f"{base}.backoffLimit", "BackoffLimit is incompatible with ClusterSelector mode")
    if mode not in SUBMISSION_MODES:
        add(f"{base}.submissionMode", f"unknown submissionMode {mode!r}; KubeRay knows {', '.join(SUBMISSION_MODES)}")
    if mode == "InteractiveMode" and isinstance(backoff, int) and backoff > 0:
        add(f"{base}.backoffLimit", "BackoffLimit is incompatible with InteractiveMode")
    if mode == "SidecarMode":
        for field in ("submitterPodTemplate", "submitterConfig"):
            if spec.get(field) is not None:
                add(f"{base}.{field}", f"Currently, SidecarMode doesn't support {field}")
        if _get(cluster, "headGroupSpec", "template", "spec", "restartPolicy") not in (None, "", "Never"):
            add(f"{base}.rayClusterSpec.headGroupSpec.template.spec.restartPolicy", "restartPolicy for head Pod should be Never or unset when using SidecarMode")
    if isinstance(cluster, dict):
        if _get(cluster, "authOptions", "enableK8sTokenAuth") is True:
            add(f"{base}.rayClusterSpec.authOptions.enableK8sTokenAuth", "K8s token auth mode is currently not supported for RayJob")
        _no_cluster_upgrade_strategy(cluster, "RayJob", f"{base}.rayClusterSpec", add)
        check_cluster_spec(cluster, annotations, f"{base}.rayClusterSpec", gates, add)
    runtime_env = spec.get("runtimeEnvYAML")
    if isinstance(runtime_env, str) and runtime_env.strip():
        try:
            parsed = yaml.safe_load(runtime_env)
            if parsed is not None and not isinstance(parsed, dict):
                add(f"{base}.runtimeEnvYAML", f"runtimeEnvYAML must be a YAML mapping, got {type(parsed).__name__}")
        except yaml.YAMLError as e:
            add(f"{base}.runtimeEnvYAML", f"runtimeEnvYAML is not valid YAML: {str(e).splitlines()[0]}")
    for field, rule in (("activeDeadlineSeconds", "positive"), ("preRunningDeadlineSeconds", "positive"), ("backoffLimit", "non-negative")):
        val = spec.get(field)
        if isinstance(val, int) and (val <= 0 if rule == "positive" else val < 0):
            add(f"{base}.{field}", f"{field} must be a {rule} integer, got {val}")


def _deletion_rules(spec: dict, path: str, gates: dict[str, bool], add: Add) -> None:
    strategy, shutdown = spec["deletionStrategy"], spec.get("shutdownAfterJobFinishes") is True
    selector, autoscaling = bool(spec.get("clusterSelector")), _autoscaling(spec.get("rayClusterSpec"))
    if not gates["RayJobDeletionPolicy"]:
        add(path, "RayJobDeletionPolicy feature gate must be enabled to use DeletionStrategy")
    legacy = strategy.get("onSuccess") is not None or strategy.get("onFailure") is not None
    rules = [r for r in strategy.get("deletionRules") or [] if isinstance(r, dict)]
    if rules and shutdown:
        add(f"{path}.deletionRules", "spec.shutdownAfterJobFinishes and spec.deletionStrategy.deletionRules are mutually exclusive")
    if rules and legacy:
        add(path, "Cannot use both legacy onSuccess/onFailure fields and deletionRules simultaneously")
    if legacy:
        policies = {}
        for when in ("onSuccess", "onFailure"):
            policies[when] = _get(strategy, when, "policy")
            if strategy.get(when) is None:
                add(f"{path}.{when}", "both DeletionStrategy.OnSuccess and DeletionStrategy.OnFailure must be set when using the legacy deletion policy fields")
            elif policies[when] is None:
                add(f"{path}.{when}.policy", f"the DeletionPolicyType field of DeletionStrategy.{when} cannot be unset when DeletionStrategy is enabled")
            elif selector and policies[when] in ("DeleteCluster", "DeleteWorkers"):
                add(f"{path}.{when}.policy", f"the ClusterSelector mode doesn't support DeletionStrategy={policies[when]}")
        if "DeleteWorkers" in policies.values() and autoscaling:
            add(path, "DeletionStrategy=DeleteWorkers currently does not support RayCluster with autoscaling enabled")
        if shutdown and "DeleteNone" in policies.values():
            add(path, "shutdownAfterJobFinishes is set to 'true' while deletion policy is 'DeleteNone'")
    elif not rules:
        add(path, "DeletionStrategy requires either BOTH onSuccess and onFailure, OR the deletionRules field (cannot be empty)")
    by_condition: dict[tuple[str, str], dict[str, int]] = {}
    for i, rule in enumerate(rules if not legacy else []):
        cond, policy, rule_path = rule.get("condition") or {}, rule.get("policy"), f"{path}.deletionRules[{i}]"
        has_status, has_deploy = cond.get("jobStatus") is not None, cond.get("jobDeploymentStatus") is not None
        ttl = cond.get("ttlSeconds") or 0
        if has_status == has_deploy:
            add(f"{rule_path}.condition", "exactly one of JobStatus and JobDeploymentStatus must be set")
            continue
        if isinstance(ttl, int) and ttl < 0:
            add(f"{rule_path}.condition.ttlSeconds", "TTLSeconds must be non-negative")
            continue
        if selector and policy in ("DeleteCluster", "DeleteWorkers"):
            add(f"{rule_path}.policy", f"DeletionPolicyType {policy!r} not supported when ClusterSelector is set")
            continue
        if autoscaling and policy == "DeleteWorkers":
            add(f"{rule_path}.policy", "DeletionPolicyType 'DeleteWorkers' not supported with autoscaling enabled")
            continue
        key = ("JobStatus", cond["jobStatus"]) if has_status else ("JobDeploymentStatus", cond["jobDeploymentStatus"])
        if policy in by_condition.setdefault(key, {}):
            add(rule_path, f"duplicate rule for DeletionPolicyType {policy!r} and {key[0]} {key[1]!r}")
            continue
        by_condition[key][str(policy)] = ttl
    for (ctype, cvalue), ttls in by_condition.items():
        order = [(p, ttls[p]) for p in ("DeleteWorkers", "DeleteCluster", "DeleteSelf") if p in ttls]
        for (prev, prev_ttl), (cur, cur_ttl) in zip(order, order[1:]):
            if cur_ttl < prev_ttl:
                add(f"{path}.deletionRules", f"for {ctype} {cvalue!r}: {cur} TTL ({cur_ttl}) must be >= {prev} TTL ({prev_ttl})")


def _no_cluster_upgrade_strategy(cluster: dict, owner: str, base: str, add: Add) -> None:
    # ValidateRayClusterUpgradeOptions runs on the RayCluster the owner creates, labelled as originating from it.
    if _get(cluster, "upgradeStrategy", "type") is not None:
        add(f"{base}.upgradeStrategy", f"upgradeStrategy cannot be set when RayCluster is created by {owner}")


def check_rayservice_spec(spec: dict, annotations: dict, gates: dict[str, bool], add: Add) -> None:
    """ValidateRayServiceSpec and ValidateClusterUpgradeOptions."""
    cluster = spec.get("rayClusterConfig")
    if _get(cluster, "authOptions", "enableK8sTokenAuth") is True:
        add("spec.rayClusterConfig.authOptions.enableK8sTokenAuth", "K8s token auth mode is currently not supported for RayService")
    if isinstance(cluster, dict):
        _no_cluster_upgrade_strategy(cluster, "RayService", "spec.rayClusterConfig", add)
        check_cluster_spec(cluster, annotations, "spec.rayClusterConfig", gates, add)
    if _get(cluster, "headGroupSpec", "headService", "metadata", "name"):
        add("spec.rayClusterConfig.headGroupSpec.headService.metadata.name", "headService.metadata.name should not be set for a RayService")
    upgrade_type = _get(spec, "upgradeStrategy", "type")
    if upgrade_type is not None and upgrade_type not in ("None", "NewCluster", "NewClusterWithIncrementalUpgrade"):
        add("spec.upgradeStrategy.type", f"Spec.UpgradeStrategy.Type value {upgrade_type} is invalid, valid options are NewClusterWithIncrementalUpgrade, NewCluster, or None")
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if isinstance(delay, int) and delay < 0:
        add("spec.rayClusterDeletionDelaySeconds", f"should be a non-negative integer, got {delay}")
    if upgrade_type != "NewClusterWithIncrementalUpgrade" or not gates["RayServiceIncrementalUpgrade"]:
        return
    if not _autoscaling(cluster):
        add("spec.rayClusterConfig.enableInTreeAutoscaling", "Ray Autoscaler is required for NewClusterWithIncrementalUpgrade")
    options, path = _get(spec, "upgradeStrategy", "clusterUpgradeOptions"), "spec.upgradeStrategy.clusterUpgradeOptions"
    if not isinstance(options, dict):
        return add(path, "ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade")
    surge, step, interval = options.get("maxSurgePercent", 100), options.get("stepSizePercent"), options.get("intervalSeconds")
    if not isinstance(surge, int) or not 0 <= surge <= 100:
        add(f"{path}.maxSurgePercent", "maxSurgePercent must be between 0 and 100")
    if not isinstance(step, int) or not 0 <= step <= 100:
        add(f"{path}.stepSizePercent", "stepSizePercent must be between 0 and 100")
    elif isinstance(surge, int) and step > surge:
        add(f"{path}.stepSizePercent", "stepSizePercent must be less than or equal to maxSurgePercent")
    if not isinstance(interval, int) or interval <= 0:
        add(f"{path}.intervalSeconds", "intervalSeconds must be greater than 0")
    if not options.get("gatewayClassName"):
        add(f"{path}.gatewayClassName", "gatewayClassName is required for NewClusterWithIncrementalUpgrade")


def _initializing_timeout(annotations: dict, add: Add) -> None:
    value = annotations.get("ray.io/initializing-timeout")
    if not value:
        return
    path = "metadata.annotations[ray.io/initializing-timeout]"
    duration = re.fullmatch(r"[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+", str(value))
    if duration or re.fullmatch(r"[-+]?\d+", str(value)):
        if str(value).startswith("-") or not re.search(r"[1-9]", str(value)):
            add(path, f"annotation ray.io/initializing-timeout must be positive, got: {value}")
    else:
        add(path, f"annotation ray.io/initializing-timeout has invalid format: {value}. Expected Go duration (e.g. '5m', '1h') or positive integer seconds")


def check_kuberay_rules(doc: dict, feature_gates: dict[str, bool] | None = None) -> list[Problem]:
    """Layer 2: what the KubeRay v1.7.0 operator (and its RayCluster webhook) would reject in `doc`."""
    gates = {**DEFAULT_FEATURE_GATES, **(feature_gates or {})}
    problems: list[Problem] = []

    def add(path: str, message: str) -> None:
        problems.append(Problem(path, message, LAYER))

    kind, meta, spec = doc.get("kind"), _map(doc.get("metadata")), doc.get("spec") or {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
    if not isinstance(spec, dict):
        return problems
    if kind == "RayCluster":
        _name_rules(meta, "RayCluster", MAX_RAYCLUSTER_NAME, add)
        if isinstance(meta.get("name"), str) and not _WEBHOOK_NAME.fullmatch(meta["name"]):
            add("metadata.name", "name must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character")
        if _get(spec, "upgradeStrategy", "type") not in (None, "Recreate", "None"):
            add("spec.upgradeStrategy.type", "valid options are Recreate or None")
        origin = _get(meta, "labels", "ray.io/originated-from-crd")
        if origin in ("RayJob", "RayService"):
            _no_cluster_upgrade_strategy(spec, origin, "spec", add)
        check_cluster_spec(spec, annotations, "spec", gates, add)
    elif kind == "RayJob":
        _name_rules(meta, "RayJob", MAX_RAYJOB_NAME, add)
        check_rayjob_spec(spec, annotations, "spec", gates, add)
    elif kind == "RayService":
        _name_rules(meta, "RayService", MAX_RAYSERVICE_NAME, add)
        _initializing_timeout(annotations, add)
        check_rayservice_spec(spec, annotations, gates, add)
    elif kind == "RayCronJob":
        if not gates["RayCronJob"]:
            add("kind", "RayCronJob needs the RayCronJob feature gate, which is off by default in KubeRay v1.7.0")
        if "TZ" in str(spec.get("schedule", "")):
            add("spec.schedule", "cannot use TZ or CRON_TZ in schedule, use timeZone field instead")
        elif len(str(spec.get("schedule", "")).split()) != 5 and not str(spec.get("schedule", "")).startswith("@"):
            add("spec.schedule", f"invalid cron schedule {spec.get('schedule')!r}: expected 5 fields")
        if spec.get("timeZone") == "":
            add("spec.timeZone", "timeZone must not be empty string, omit the field to use the operator's local time zone")
        if isinstance(spec.get("jobTemplate"), dict):
            check_rayjob_spec(spec["jobTemplate"], annotations, "spec.jobTemplate", gates, add)
    return problems
