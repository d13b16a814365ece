"""Render a stage config into a KubeRay manifest: RayJob for batch stages, RayService for serving.

    python -m pipelines.render --stage train --config configs/train/tiny.yaml [--profile configs/k8s/default.yaml]
                               [--image IMAGE] [-o rayjobs/rendered/train-tiny.yaml]

The entrypoint, runtime env and role come from rayjobs/stages.py (the same as `pipelines.submit`), the
cluster size from the stage config (`workload_shape`), the rest from the cluster profile. A stage's file holds
its RayJob or RayService and, after it, the NetworkPolicy that lets that cluster's pods reach each other (and for
a rollout with `webhook_port`, the one letting MLflow deliver webhooks to its head).
`--shipped` also writes what the namespace needs once (`PLATFORM`): the Namespace (Pod Security restricted), the
NetworkPolicies, a ServiceAccount per role and the rollout's Role. Every rendered document is validated offline
(rayjobs/validate.py) before anything is written.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from pathlib import Path

import yaml

from core.config import ConfigError, load_config, require
from rayjobs import stages
from rayjobs.cluster_profile import Profile
from rayjobs.credentials import ADMIN_KEY_FILE, WEBHOOK_SECRET_FILE
from rayjobs.manifests import Shape, k8s_name, rayjob, rayservice
from rayjobs.namespace import namespace, service_accounts
from rayjobs.network_policy import cluster_policy, namespace_policies, webhook_policy, webhook_port
from rayjobs.roles import ROLLOUT, get_role

DEFAULT_PROFILE = stages.PROJECT_ROOT / "configs" / "k8s" / "default.yaml"

# Rendered manifests of the shipped configs: (stage, config) -> rayjobs/<file>. A test re-renders them.
SHIPPED = {
    "data-sample.yaml": ("data", "configs/data/sample.yaml"),
    "train-tiny.yaml": ("train", "configs/train/tiny.yaml"),
    "train-small-gpu.yaml": ("train", "configs/train/small_gpu.yaml"),
    "tune-tiny.yaml": ("tune", "configs/tune/tiny.yaml"),
    "batch-eval-tiny.yaml": ("batch_infer", "configs/batch/eval_tiny.yaml"),
    "batch-gpu.yaml": ("batch_infer", "configs/batch/gpu_example.yaml"),
    "rollout-tiny.yaml": ("rollout", "configs/rollout/tiny.yaml"),
    "serve-gpu.yaml": ("serve", "configs/serve/gpu_example.yaml"),
}


def _gpu_pods(total_gpus: int, per_unit: int, profile: Profile) -> tuple[int, int]:
    """(pods, GPUs per pod) holding `total_gpus`, never splitting one unit (an engine or a worker) across pods."""
    per_pod = max(per_unit, min(profile.gpu.gpus_per_pod, total_gpus))
    per_pod -= per_pod % per_unit
    return math.ceil(total_gpus / per_pod), per_pod


def _engine_shape(engine, replicas: int, profile: Profile, min_replicas: int | None = None) -> Shape:
    gpus = engine.tensor_parallel_size * engine.pipeline_parallel_size
    if engine.accelerator != "gpu":
        return Shape(workers=replicas, min_workers=min_replicas)
    pods, per_pod = _gpu_pods(gpus * replicas, gpus, profile)
    min_pods = None if min_replicas is None else math.ceil(gpus * min_replicas / per_pod)
    return Shape(workers=pods, gpus_per_worker=per_pod, accelerator_type=engine.accelerator_type, min_workers=min_pods)


def workload_shape(stage: str, cfg, profile: Profile) -> Shape:
    """The worker pods a stage needs, read from its own config."""
    if stage == "tune" and cfg.post_train_stage() == "grpo":
        # Each trial is a GRPO run: the GRPO stage's shape, once per trial running at once.
        one = workload_shape("grpo", cfg.base_config(), profile)
        trials = max(1, cfg.max_concurrent_trials)
        return dataclasses.replace(one, workers=one.workers * trials,
                       min_workers=None if one.min_workers is None else one.min_workers * trials)
    if stage in ("train", "tune", "dpo"):  # DPO trains on the train stage's workers (posttrain/dpo_stage.py)
        train = cfg.base_train_config() if stage == "tune" else cfg
        sc = train.scaling
        # A search runs max_concurrent_trials at once (0 = derive: the search then runs one at a time on this size).
        trials = max(1, cfg.max_concurrent_trials) if stage == "tune" else 1
        # A worker pod given notice drains this long: the ranks checkpoint meanwhile (train/notice.py).
        drain = train.checkpoint.notice_grace_s
        # An elastic run (num_workers: [min, max]) gets a worker group that autoscales between the two: it starts
        # with what it gets and grows as pods come (train/config.py ScalingConfig.num_workers).
        lowest = sc.min_workers if sc.elastic else None
        if sc.use_gpu:
            per_worker = int(sc.resources_per_worker.get("GPU", 1))
            pods, per_pod = _gpu_pods(sc.max_workers * per_worker * trials, per_worker, profile)
            min_pods = None if lowest is None else math.ceil(lowest * per_worker * trials / per_pod)
            return Shape(workers=pods, gpus_per_worker=per_pod, drain_s=drain, min_workers=min_pods)
        return Shape(workers=sc.max_workers * trials, drain_s=drain,
                     min_workers=None if lowest is None else lowest * trials)
    if stage == "batch_infer":
        return _engine_shape(cfg.engine, cfg.num_engines, profile)
    if stage == "serve":
        return _engine_shape(cfg.engine, cfg.autoscaling.max_replicas, profile, cfg.autoscaling.min_replicas)
    if stage == "data":
        return Shape(workers=2)
    if stage == "grpo":
        # Colocated roles take turns in one worker (its engines' shape on GPU); separate ones get a worker each. A
        # reward model's engines (reward.name: model) are actors of their own: a worker each, beside the roles'.
        roles = cfg.num_engines + cfg.policy.num_workers if cfg.placement == "separate" else 1
        rewards = cfg.reward.num_engines if cfg.reward.name == "model" else 0
        if cfg.engine.accelerator != "gpu":
            return Shape(workers=roles + rewards)
        shape = _engine_shape(cfg.engine, roles, profile)
        if rewards and cfg.reward.engine.accelerator == "gpu":
            extra = _engine_shape(cfg.reward.engine, rewards, profile)
            shape = dataclasses.replace(shape, workers=shape.workers + extra.workers)
        return shape
    return Shape(workers=0)  # rollout: HTTP and MLflow calls only; the driver runs on the head.


def load_profile(path: str | Path | None, image: str | None = None) -> Profile:
    return load_config(Profile, path or DEFAULT_PROFILE, [f"image={image}"] if image else [])


def render(stage: str, config: str, profile: Profile, overrides: list[str] | None = None) -> dict:
    """The manifest (a dict) for `stage` run with `config`."""
    st = stages.get_stage(stage)
    cfg = load_config(stages.config_class(st), config, overrides)
    shape = workload_shape(stage, cfg, profile)
    name = k8s_name(f"rayline-{stage}-{Path(config).stem}")
    annotations = {"rayline.io/config": stages.relative_config(config), "rayline.io/stage": stage}
    if st.kind == "RayService":
        from serve.online.app import render_serve_config

        return rayservice(name, render_serve_config(cfg), shape, profile, annotations)
    runtime_env = stages.job_runtime_env(profile.working_dir, record_commit=False)
    entry = stages.entrypoint(st, config, overrides)
    webhook = rollout_webhook_port(cfg, profile) if stage == "rollout" else 0
    return rayjob(name, stage, entry, runtime_env, shape, profile, get_role(st.role), annotations, webhook)


def rollout_webhook_port(cfg, profile: Profile) -> int:
    """The port the rollout's head takes MLflow webhook deliveries on (0: none), once the rollout config `cfg` is
    known to read the files its pods mount: the admin key and, with `webhook_port`, the webhook secret
    (rayjobs/credentials.py). A path of its own in the config would win over the mounted file's env var and be
    missing in the pod; a receiver on loopback would be unreachable for MLflow."""
    from serve.promotion.rollout import load_serve_config

    secrets = profile.secrets
    if secrets.openai_admin_key:
        admin = load_serve_config(cfg).auth.admin_key_file
        require(admin in ("", ADMIN_KEY_FILE), "auth.admin_key_file",
                f"{cfg.serve_config} names {admin}, but the rollout's pods mount the admin key (Secret "
                f"{secrets.openai_admin_key}) at {ADMIN_KEY_FILE} (RAYLINE_ADMIN_KEY_FILE): leave it empty")
    if not cfg.webhook_port:
        return 0
    require(bool(secrets.mlflow_webhook), "secrets.mlflow_webhook",
            f"the rollout config sets webhook_port={cfg.webhook_port}, whose receiver does not start without the "
            "secret MLflow signs deliveries with: name its Secret in the profile")
    require(cfg.webhook_secret_file in ("", WEBHOOK_SECRET_FILE), "webhook_secret_file",
            f"{cfg.webhook_secret_file}: the rollout's pods mount the webhook secret (Secret {secrets.mlflow_webhook}) "
            f"at {WEBHOOK_SECRET_FILE} (RAYLINE_WEBHOOK_SECRET_FILE): leave it empty")
    try:
        loopback = cfg.webhook_host == "localhost" or ipaddress.ip_address(cfg.webhook_host).is_loopback
    except ValueError:  # a host name: whatever it resolves to in the pod
        loopback = False
    require(not loopback, "webhook_host", f"{cfg.webhook_host} is the pod's loopback, which MLflow's deliveries "
                                          "cannot reach: set webhook_host=0.0.0.0")
    return cfg.webhook_port


def render_documents(stage: str, config: str, profile: Profile, overrides: list[str] | None = None) -> list[dict]:
    """The stage's manifest and, after it, the NetworkPolicy of the Ray cluster it creates (and for a rollout taking
    MLflow webhooks, the one letting MLflow reach its head's webhook port)."""
    doc = render(stage, config, profile, overrides)
    webhook = [webhook_policy(doc, profile)] if doc["kind"] == "RayJob" and webhook_port(doc) else []
    return [doc, cluster_policy(doc, profile), *webhook]


def validate_rendered(docs: list[dict], profile: Profile, crd_dir: Path | None = None) -> list:
    """Every problem of `docs`, each prefixed with the document's kind when there are several."""
    from rayjobs.validate import validate_manifest

    return [dataclasses.replace(p, path=f"{doc['kind']} {doc['metadata']['name']}: {p.path}") if len(docs) > 1 else p
            for doc in docs
            for p in validate_manifest(doc, crd_dir=crd_dir, project_root=stages.PROJECT_ROOT, profile=profile)]


def _write(out: str | Path, header: str, docs: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(header + yaml.safe_dump_all(docs, sort_keys=False))


def render_to_file(stage: str, config: str, out: str | Path, profile: Profile,
                   overrides: list[str] | None = None, crd_dir: Path | None = None) -> list:
    """Render, validate and write; returns the validation problems (the file is written only when there are none)."""
    docs = render_documents(stage, config, profile, overrides)
    problems = validate_rendered(docs, profile, crd_dir)
    if not problems:
        shown = stages.relative_config(config)  # as the job sees it; never this machine's checkout path
        _write(out, f"# Rendered by `python -m pipelines.render --stage {stage} --config {shown}`; "
                    "do not edit by hand.\n", docs)
    return problems


ROLLOUT_RBAC = "rbac/rollout-rbac.yaml"  # under rayjobs/: Kubernetes objects, not Ray clusters
_SHIPPED_HEADER = "# Rendered by `python -m pipelines.render --shipped`; do not edit by hand. "


def render_rollout_rbac(out: str | Path, profile: Profile) -> list:
    """The rollout's Role and RoleBinding (rayjobs/rollout_rbac.py) for every shipped RayService, bound to the
    rollout's service account; validated, then written; returns the problems."""
    from rayjobs.rollout_rbac import check_rbac, rollout_rbac

    names = [render(stage, str(stages.PROJECT_ROOT / config), profile)["metadata"]["name"]
             for stage, config in SHIPPED.values() if stages.get_stage(stage).kind == "RayService"]
    docs = rollout_rbac(profile.namespace, names, ROLLOUT.service_account)
    problems = [p for doc in docs for p in check_rbac(doc)]
    if not problems:
        _write(out, _SHIPPED_HEADER + "What the rollout needs\n# with `target: kubernetes` (rayjobs/rollout_rbac.py), "
                                      f"for its own service account {ROLLOUT.service_account}.\n", docs)
    return problems


# What a namespace needs once, before any stage's manifest: file under rayjobs/ -> (what it holds, its documents).
PLATFORM = {
    "namespace/namespace.yaml": ("The namespace, with Pod Security `restricted` enforced\n# (rayjobs/namespace.py).",
                                 lambda profile: [namespace(profile)]),
    "namespace/network-policies.yaml": ("Deny all traffic in the namespace, then allow what\n# rayline needs "
                                        "(rayjobs/network_policy.py; each stage's file adds its cluster's policy).",
                                        namespace_policies),
    "rbac/service-accounts.yaml": ("One ServiceAccount per role; only the rollout's mounts a\n# token "
                                   "(rayjobs/roles.py, rayjobs/namespace.py).", service_accounts),
}


def render_platform(out_dir: Path, profile: Profile) -> dict[str, list]:
    """Write every PLATFORM file under `out_dir` (each only when its documents validate); problems per file."""
    results = {}
    for fname, (what, build) in PLATFORM.items():
        docs = build(profile)
        results[fname] = validate_rendered(docs, profile)
        if not results[fname]:
            _write(out_dir / fname, f"{_SHIPPED_HEADER}{what}\n", docs)
    return results


def render_shipped(out_dir: Path | None = None, profile: Profile | None = None) -> dict[str, list]:
    """Re-render every shipped manifest into `out_dir` (default rayjobs/); returns problems per file."""
    out_dir = out_dir or stages.PROJECT_ROOT / "rayjobs" / "rendered"
    profile = profile or load_profile(None)
    results = {}
    for fname, (stage, config) in SHIPPED.items():
        try:
            results[fname] = render_to_file(stage, str(stages.PROJECT_ROOT / config), out_dir / fname, profile)
        except (ConfigError, ValueError) as e:
            results[fname] = [str(e)]
    results[ROLLOUT_RBAC] = render_rollout_rbac(out_dir / ROLLOUT_RBAC, profile)
    return {**results, **render_platform(out_dir, profile)}
