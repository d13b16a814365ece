"""Build KubeRay `ray.io/v1` RayJob and RayService objects from a workload shape and a cluster profile.

Pure functions from (Shape, Profile, Role, ...) to plain dicts; `rayjobs/render.py` derives the shape from a
stage config and writes the YAML. Security defaults: Ray token auth on (`authOptions.mode: token`), the head
Service stays ClusterIP (no dashboard/GCS/client port exposed outside the cluster), every pod restricted
(rayjobs/pod_security.py) under its role's ServiceAccount with its role's credentials only, secrets by
secretKeyRef or Secret volume (rayjobs/credentials.py), and labels its cluster's NetworkPolicy selects
(rayjobs/network_policy.py).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace

import yaml

from core.config import require
from core.ray_env import SERVE_PROCESS_ENV
from rayjobs.cluster_profile import RAY_VERSION, Profile
from rayjobs.credentials import role_env, role_volumes
from rayjobs.pod_security import autoscaler_options, harden_pod, kube_api_token_volume
from rayjobs.roles import CLUSTER_LABEL, KUBE_API_LABEL, POD_LABELS, ROLE_LABEL, ROLES, SERVING, Role


@dataclass(frozen=True)
class Shape:
    """What a stage needs from the cluster."""

    workers: int
    """Worker pods."""
    gpus_per_worker: int = 0
    cpus_per_worker: str | None = None
    """Pod CPU (Kubernetes quantity); None = the profile's pod size."""
    accelerator_type: str | None = None
    min_workers: int | None = None
    """Lower bound for autoscaling (RayService); None = fixed size."""
    drain_s: float | None = None
    """Seconds a worker pod has from its termination notice (SIGTERM: a spot reclaim, a deletion) to its end, for the
    work on it to save itself (train: checkpoint.notice_grace_s); None = Ray's and Kubernetes' defaults."""

    @property
    def gpu(self) -> bool:
        return self.gpus_per_worker > 0


def k8s_name(text: str, limit: int = 47) -> str:
    """A DNS-1035 label from free text (KubeRay caps RayJob/RayService names at 47 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name) or "rayline"
    return name[:limit].rstrip("-")


def _env(profile: Profile, role: Role, extra: dict[str, str] | None = None, webhook: bool = False) -> list[dict]:
    return role_env(profile, role, webhook) + [{"name": k, "value": v} for k, v in (extra or {}).items()]


def _container(name: str, profile: Profile, cpu: str, memory: str, gpus: int, env: list[dict],
               ports: list[tuple[str, int]] = ()) -> dict:
    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    c = {
        "name": name, "image": profile.image_ref, "imagePullPolicy": "IfNotPresent", "env": copy.deepcopy(env),
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if profile.working_dir is None:
        c["workingDir"] = profile.code_dir
    if ports:
        c["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
    return c


# Ray 2.60's `ray start --block` (a pod's main process once bash execs the last command of KubeRay's
# `bash -c "ulimit ...; ray start ..."`: docs/KUBERNETES.md) turns SIGTERM into a drain of its node: reason PREEMPTION, deadline this many seconds on, which Ray Train
# hands its workers as a preemption notice (train/notice.py); at the deadline it stops the node's processes.
DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# Beyond the drain, what the pod needs to stop its processes (Ray gives each a graceful stop) before Kubernetes kills it.
STOP_MARGIN_S = 15


def termination_grace_s(drain_s: float) -> int:
    """The worker pods' terminationGracePeriodSeconds for a drain window of `drain_s` seconds."""
    return math.ceil(drain_s) + STOP_MARGIN_S


# Where each Ray node's metrics agent serves Prometheus metrics (Ray's, Serve's, vLLM's and rayline's own);
# the port is named so a PodMonitor (rayjobs/monitoring.py) can select it.
METRICS_PORT = ("metrics", 8080)
SERVE_PORT, DASHBOARD_PORT = 8000, 8265
WEBHOOK_PORT_NAME = "mlflow-webhook"  # the head's port the rollout's webhook receiver listens on, when it has one


def _labels(role: Role, cluster: str, kube_api: bool = False) -> dict[str, str]:
    """A pod's labels: rayline's, its role, its Ray cluster (rayjobs/network_policy.py selects on them)."""
    return {**POD_LABELS, ROLE_LABEL: role.name, CLUSTER_LABEL: cluster, **({KUBE_API_LABEL: "true"} if kube_api else {})}


def _pod(container: dict, profile: Profile, role: Role, cluster: str, gpu: bool = False,
         accelerator_type: str | None = None, kube_api: bool = False, token_volume: bool = False,
         webhook: bool = False) -> dict:
    """A restricted pod (rayjobs/pod_security.py) with the role's credentials (rayjobs/credentials.py).
    `kube_api`: the Ray container calls the Kubernetes API (the rollout's driver); `token_volume`: only a sidecar
    does (the autoscaler), through a projected token; `webhook`: it takes MLflow webhook deliveries."""
    volumes, mounts = role_volumes(profile, role, webhook)
    container = {**container, "volumeMounts": container["volumeMounts"] + mounts}
    spec = {
        "serviceAccountName": role.service_account,
        "containers": [container],
        # Ray's object store and NCCL use /dev/shm; the container default (64 MiB) is far too small.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}}, *volumes],
    }
    if token_volume:
        spec["volumes"].append(kube_api_token_volume())
    if gpu:
        spec["nodeSelector"] = profile.gpu.node_selector(accelerator_type)
        spec["tolerations"] = [dict(t) for t in profile.gpu.tolerations]
    harden_pod(spec, profile, kube_api)
    return copy.deepcopy({"metadata": {"labels": _labels(role, cluster, kube_api or token_volume)}, "spec": spec})


def cluster_spec(shape: Shape, profile: Profile, env: dict[str, str] | None = None, serve: bool = False,
                 role: Role | None = None, name: str = "rayline", webhook_port: int = 0) -> dict:
    """A RayCluster spec for the manifest `name`: a head that carries no work (num-cpus 0) and one worker group
    sized by `shape` (with its drain window on the workers: DRAIN_TIMEOUT_ENV), every pod acting as `role` (default: serving for `serve`, else trainer). A serving
    cluster's pods also carry Serve's request-path settings (SERVE_PROCESS_ENV). With a `shape.min_workers` below
    `shape.workers` the cluster autoscales (autoscaler v2) between the two, starting at the minimum.
    `webhook_port`: the driver (on the head) takes MLflow webhook deliveries there; the pods mount their secret."""
    role = role or (SERVING if serve else ROLES["trainer"])
    webhook = webhook_port > 0
    envs = _env(profile, role, {**SERVE_PROCESS_ENV, **(env or {})} if serve else env, webhook)
    head_ports = [("gcs-server", 6379), ("dashboard", DASHBOARD_PORT), ("client", 10001), METRICS_PORT] + (
        [("serve", SERVE_PORT)] if serve else [])
    if webhook:
        require(webhook_port not in {port for _, port in head_ports}, "webhook_port",
                f"{webhook_port} is a port Ray uses on the head ({', '.join(f'{n} {p}' for n, p in head_ports)}); "
                "pick another")
        head_ports.append((WEBHOOK_PORT_NAME, webhook_port))
    head = _container("ray-head", profile, profile.head.cpu, profile.head.memory, 0, envs, head_ports)
    if shape.gpu:
        cpu, memory, group = shape.cpus_per_worker or profile.gpu.cpu, profile.gpu.memory, "gpu-workers"
    else:
        cpu, memory, group = shape.cpus_per_worker or profile.cpu_worker.cpu, profile.cpu_worker.memory, "cpu-workers"
    drain = [{"name": DRAIN_TIMEOUT_ENV, "value": f"{shape.drain_s:g}"}] if shape.drain_s else []
    worker = _container("ray-worker", profile, cpu, memory, shape.gpus_per_worker, envs + drain, [METRICS_PORT])
    metrics_params = {"metrics-export-port": str(METRICS_PORT[1])}
    min_workers = shape.workers if shape.min_workers is None else shape.min_workers
    autoscaling = min_workers < shape.workers
    worker_group = {
        "groupName": group,
        "replicas": min_workers,
        "minReplicas": min_workers,
        "maxReplicas": shape.workers,
        "rayStartParams": dict(metrics_params),
        "template": _pod(worker, profile, role, name, shape.gpu, shape.accelerator_type, webhook=webhook),
    }
    if shape.drain_s:
        worker_group["template"]["spec"]["terminationGracePeriodSeconds"] = termination_grace_s(shape.drain_s)
    spec = {
        "rayVersion": RAY_VERSION,
        "authOptions": {"mode": "token"},
        "headGroupSpec": {
            "serviceType": "ClusterIP",
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", **metrics_params},
            # The rollout's driver runs on the head; an autoscaling head's autoscaler patches its RayCluster.
            "template": _pod(head, profile, role, name, kube_api=role.kube_api,
                             token_volume=autoscaling and not role.kube_api, webhook=webhook),
        },
        "workerGroupSpecs": [worker_group],
    }
    if autoscaling:
        auto = profile.autoscaling
        spec["enableInTreeAutoscaling"] = True
        spec["autoscalerOptions"] = {"version": "v2", "idleTimeoutSeconds": auto.idle_timeout_s,
                                     "upscalingMode": auto.upscaling_mode, **autoscaler_options(profile)}
    return spec


def _metadata(name: str, profile: Profile, stage: str, annotations: dict[str, str] | None = None) -> dict:
    labels = {**POD_LABELS, "app.kubernetes.io/component": stage.replace("_", "-")}
    if profile.kueue_queue:
        labels["kueue.x-k8s.io/queue-name"] = profile.kueue_queue
    meta = {"name": k8s_name(name), "namespace": profile.namespace, "labels": labels}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def job_shape(shape: Shape, profile: Profile) -> Shape:
    """A job's shape under the profile: with `autoscaling.jobs` its cluster starts at `min_job_workers` pods."""
    if not profile.autoscaling.jobs or shape.workers == 0:
        return shape
    return replace(shape, min_workers=min(profile.autoscaling.min_job_workers, shape.workers))


def submitter_template(profile: Profile, role: Role, cluster: str) -> dict:
    """The pod KubeRay runs `ray job submit` in (K8sJobMode): KubeRay's default container and sizes, restricted like
    every other pod and in its cluster's network group; it needs no credentials (KubeRay gives it the Ray token)."""
    limits, requests = {"cpu": "1", "memory": "1Gi"}, {"cpu": "500m", "memory": "200Mi"}
    spec = {"restartPolicy": "Never", "serviceAccountName": role.service_account, "containers": [{
        "name": "ray-job-submitter", "image": profile.image_ref, "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": requests, "limits": limits}}]}
    harden_pod(spec, profile, kube_api=False)
    return {"metadata": {"labels": _labels(role, cluster)}, "spec": spec}


def rayjob(name: str, stage: str, entrypoint: str, runtime_env: dict, shape: Shape, profile: Profile, role: Role,
           annotations: dict[str, str] | None = None, webhook_port: int = 0) -> dict:
    """A RayJob that creates its own cluster, runs `entrypoint` as `role`, and deletes the cluster afterwards;
    `webhook_port`: its driver takes MLflow webhook deliveries on that port of the head."""
    meta = _metadata(name, profile, stage, annotations)
    spec = {
        "entrypoint": entrypoint,
        "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=True),
        "rayClusterSpec": cluster_spec(job_shape(shape, profile), profile, role=role, name=meta["name"],
                                       webhook_port=webhook_port),
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": profile.ttl_seconds_after_finished,
        "activeDeadlineSeconds": profile.active_deadline_seconds,
        "submissionMode": profile.submission_mode,
        "submitterConfig": {"backoffLimit": profile.submitter_backoff_limit},
    }
    if profile.submission_mode == "K8sJobMode":
        spec["submitterPodTemplate"] = submitter_template(profile, role, meta["name"])
    if profile.kueue_queue:
        spec["suspend"] = True  # Kueue un-suspends the job once it admits it.
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": spec}


def gcs_fault_tolerance(profile: Profile) -> dict | None:
    """KubeRay's `gcsFaultToleranceOptions` from the profile (Redis backend; the password only by secretKeyRef)."""
    ft = profile.gcs_fault_tolerance
    if not ft.redis_address:
        return None
    options: dict = {"redisAddress": ft.redis_address}
    if ft.password_secret:
        options["redisPassword"] = {"valueFrom": {"secretKeyRef": {"name": ft.password_secret, "key": ft.password_key}}}
    if ft.external_storage_namespace:
        options["externalStorageNamespace"] = ft.external_storage_namespace
    return options


def rayservice(name: str, serve_config: dict, shape: Shape, profile: Profile,
               annotations: dict[str, str] | None = None) -> dict:
    """A RayService running `serve_config` (the `serve deploy` schema) on a cluster sized by `shape`."""
    meta = _metadata(name, profile, "serve", annotations)
    spec = {
        "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
        "rayClusterConfig": cluster_spec(shape, profile, serve=True, name=meta["name"]),
    }
    ft = gcs_fault_tolerance(profile)
    if ft:
        spec["rayClusterConfig"]["gcsFaultToleranceOptions"] = ft
    if profile.upgrade_strategy != "None":
        spec["upgradeStrategy"] = {"type": profile.upgrade_strategy}
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": meta, "spec": spec}
