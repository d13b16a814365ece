"""rayline's own preflight: manifests that KubeRay accepts but that would hang, OOM or leak once they run.

(a) placement groups no pod can host: a deployment's `placement_group_bundles` (or an LLM config's TP x PP GPU
    bundles) with STRICT_PACK must fit, summed, on one pod of some group; with PACK/SPREAD each bundle must fit
    some pod (STRICT_SPREAD: enough such pods). A pod's Ray resources come from rayStartParams num-cpus/num-gpus,
    the group's `resources`, else the Ray container's limits (requests) cpu and `nvidia.com/gpu`.
    A replica's ray_actor_options and a RayJob's entrypointNum* must fit some pod as well.
(b) an accelerator type (`ray_actor_options.accelerator_type`, an `accelerator_type:H100` resource, an LLM config's
    `accelerator_type`) that no group provides through its nodeSelector / required node affinity
    (`nvidia.com/gpu.product`, `cloud.google.com/gke-accelerator`, ...), `ray.io/accelerator-type` label or an
    `accelerator_type:X` Ray resource: Serve would wait forever for such a node.
(c) GPU memory: `gpu_fit` (pure) says whether the weights plus one full `max_model_len` sequence of KV cache fit
    the usable GPU memory. The manifest check runs when the object carries rayline annotations:
      rayline.io/model-params        parameter count: 70000000000, 70e9 or 70B
      rayline.io/model-layers        transformer layers
      rayline.io/model-kv-heads      key/value heads (GQA)
      rayline.io/model-head-dim      head dimension
      rayline.io/model-dtype-bytes   bytes per weight / KV element (default 2)
      rayline.io/gpu-memory-gib      memory of one GPU (default: from the accelerator type, e.g. H100 = 80)
    Engine settings come from each serveConfigV2 `llm_configs[].engine_kwargs` (max_model_len,
    tensor_parallel_size, gpu_memory_utilization, max_num_seqs) or rayline's own `args.config.engine` (g), else
    from the annotations
      rayline.io/max-model-len, rayline.io/tensor-parallel-size, rayline.io/gpu-memory-utilization (default 0.9),
      rayline.io/max-num-seqs (default 256).
(d) inline secrets and (e) an exposed head: rayjobs/leak_checks.py.
(f) a worker group `replicas` outside [minReplicas, maxReplicas]: the operator silently clamps it.
(g) rayline's own app (`import_path: serve.online.app:build_app`): its `args.config` must be a serving config the builder
    accepts (serve/online/serve_config.py; TP/PP sizes on CPU, unknown fields, ...), and its engine goes through (a)-(c)
    as Ray's LLM configs do: one engine = TP x PP GPU bundles (STRICT_PACK) or one CPU bundle, from
    serve.online.engine.placement_group_config, on one pod; `engine.accelerator_type` on some group; and the pods must
    hold `autoscaling.min_replicas` (or `initial_replicas`) and `max_replicas` such engines at once.
(h) pods without rayline's hardening (restricted, no needless token, credentials per role): rayjobs/hardening.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

import yaml

from core.config import ConfigError, from_dict
from rayjobs.crd_schema import Problem
from rayjobs.leak_checks import check_exposure, check_secrets
from rayjobs.ray_schemas import load_serve_config
from serve.online.app import BUILDER
from serve.online.engine import placement_bundles, placement_strategy
from serve.online.serve_config import Config as ServeConfig

LAYER = "preflight"
GIB = 1024**3
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100-80G": 80, "A100-40G": 40, "A100": 40, "L40S": 48, "L4": 24, "A10G": 24, "T4": 16, "V100": 16}
_GPU_LABEL_KEYS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator", "karpenter.k8s.aws/instance-gpu-name")
Add = Callable[[str, str], None]


def gpu_fit(params: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, max_model_len: int,
            max_num_seqs: int, tensor_parallel_size: int, gpu_memory_bytes: int, gpu_memory_utilization: float) -> tuple[bool, str]:
    """Whether a model's weights plus one full `max_model_len` sequence of KV cache fit one GPU of a TP group.

    Per GPU: weights = params x dtype_bytes / TP; KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x
    dtype_bytes / TP (kv heads are replicated, not split, once TP exceeds them); budget = memory x utilization.
    Activations and CUDA graphs are not modelled, so passing is necessary, not sufficient. Returns (ok, explanation).
    """
    ints = dict(params=params, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size, gpu_memory_bytes=gpu_memory_bytes)
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"gpu_fit: {name} must be a positive integer, got {value!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_fit: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    tp = tensor_parallel_size
    weights = params * dtype_bytes / tp
    kv_heads_per_gpu = math.ceil(num_kv_heads / tp)
    kv_per_token = 2 * num_layers * kv_heads_per_gpu * head_dim * dtype_bytes
    budget = gpu_memory_bytes * gpu_memory_utilization
    need = weights + kv_per_token * max_model_len
    head = (f"weights {weights / GIB:.1f} GiB/GPU ({params / 1e9:.1f}B params x {dtype_bytes} B / TP {tp}) + KV for one "
            f"{max_model_len}-token sequence {kv_per_token * max_model_len / GIB:.2f} GiB ({kv_per_token / 1024:.0f} KiB/token/GPU) "
            f"= {need / GIB:.1f} GiB vs budget {budget / GIB:.1f} GiB ({gpu_memory_bytes / GIB:.0f} GiB x {gpu_memory_utilization:g})")
    if need > budget:
        if weights > budget:
            return False, f"{head}: the weights alone do not fit; raise tensor_parallel_size, quantize, or use a bigger GPU"
        return False, f"{head}: no room for one full-length sequence; lower max_model_len or raise tensor_parallel_size"
    seqs = int((budget - weights) // (kv_per_token * max_model_len))
    note = "" if seqs >= max_num_seqs else f"; only {seqs} full-length sequences fit at once (max_num_seqs={max_num_seqs}), longer batches get preempted"
    return True, f"{head}: fits{note}"


def parse_quantity(value: Any) -> float | None:
    """A Kubernetes quantity ("500m", "2", "16Gi", 4) as a float; None if unparsable."""
    m = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([numkMGTPE]|[KMGTPE]i)?", str(value).strip())
    if not m or isinstance(value, bool):
        return None
    scale = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    scale.update({f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")})
    return float(m.group(1)) * scale.get(m.group(2) or "", 1)


@dataclasses.dataclass
class PodShape:
    """What one Ray pod of a group offers the scheduler."""

    name: str
    resources: dict[str, float]
    count: int
    accelerators: list[str]


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


def accelerator_matches(accelerator: str, label_value: str) -> bool:
    """Does a node label value (`NVIDIA-H100-80GB-HBM3`, `nvidia-a100-80gb`) denote Ray accelerator type `accelerator`?"""
    want, have = _tokens(accelerator), _tokens(label_value)
    if not want:
        return False
    for i in range(len(have) - len(want) + 1):
        if have[i] == want[0] and all(h.startswith(w) for w, h in zip(want[1:], have[i + 1 :])):
            return True
    return False


def _map(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _pod_shape(group: dict, name: str, count: int) -> PodShape:
    params = _map(group.get("rayStartParams"))
    container = _map((_list(_dig(group, "template", "spec", "containers")) or [{}])[0])
    limits, requests = _map(_dig(container, "resources", "limits")), _map(_dig(container, "resources", "requests"))
    extra = {k: parse_quantity(v) or 0.0 for k, v in _map(group.get("resources")).items()}
    try:  # rayStartParams resources is KubeRay's quoted JSON: '"{\"TPU\": 4}"'
        raw = str(params.get("resources", "{}")).strip()
        extra.update(json.loads(json.loads(raw) if raw.startswith('"') else raw))
    except (ValueError, TypeError):
        pass

    def pick(ray_key: str, param: str, k8s_keys: tuple[str, ...]) -> float:
        for source in (params.get(param), extra.get(ray_key)) + tuple(d.get(k) for d in (limits, requests) for k in k8s_keys):
            if source is not None and parse_quantity(source) is not None:
                return math.ceil(parse_quantity(source)) if ray_key == "CPU" else parse_quantity(source)
        # No CPU set anywhere: Ray counts the node's CPUs, unknown here. No GPU limit: the pod sees no GPU.
        return math.inf if ray_key == "CPU" else 0.0

    gpu_keys = tuple(k for k in {**limits, **requests} if str(k).endswith("/gpu"))
    resources = {**{k: float(v) for k, v in extra.items() if isinstance(v, (int, float))},
                 "CPU": pick("CPU", "num-cpus", ("cpu",)), "GPU": pick("GPU", "num-gpus", gpu_keys)}
    pod = _map(_dig(group, "template", "spec"))
    labels = [str(v) for k, v in _map(pod.get("nodeSelector")).items() if k in _GPU_LABEL_KEYS or "gpu" in str(k) or "accelerator" in str(k)]
    for term in _list(_dig(pod, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms")):
        for expr in _list(_map(term).get("matchExpressions")):
            if _map(expr).get("operator") == "In" and (expr.get("key") in _GPU_LABEL_KEYS or "gpu" in str(expr.get("key"))):
                labels += [str(v) for v in _list(expr.get("values"))]
    labels += [k.split(":", 1)[1] for k in resources if str(k).startswith("accelerator_type:")]
    labels += [str(v) for k, v in _map(group.get("labels")).items() if k == "ray.io/accelerator-type"]
    return PodShape(name, resources, count, labels)


def _dig(obj: Any, *keys: str) -> Any:
    for k in keys:
        obj = obj.get(k) if isinstance(obj, dict) else None
    return obj


def cluster_spec_of(doc: dict) -> tuple[dict | None, str]:
    """(RayClusterSpec, its field path) of a RayCluster, RayJob, RayService or RayCronJob."""
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    where = {"RayCluster": ((), "spec"), "RayJob": (("rayClusterSpec",), "spec.rayClusterSpec"),
             "RayService": (("rayClusterConfig",), "spec.rayClusterConfig"),
             "RayCronJob": (("jobTemplate", "rayClusterSpec"), "spec.jobTemplate.rayClusterSpec")}.get(str(doc.get("kind")))
    if where is None:
        return None, ""
    cluster = _dig(spec, *where[0]) if where[0] else spec
    return (cluster if isinstance(cluster, dict) else None), where[1]


def pod_shapes(cluster: dict) -> list[PodShape]:
    """The head pod and one shape per worker group (count = maxReplicas x numOfHosts)."""
    shapes = [_pod_shape(_map(cluster.get("headGroupSpec")), "head", 1)]
    for g in _list(cluster.get("workerGroupSpecs")):
        if isinstance(g, dict):
            max_replicas = g.get("maxReplicas") if isinstance(g.get("maxReplicas"), int) else 2**31 - 1
            count = max_replicas * _count(g.get("numOfHosts"))
            shapes.append(_pod_shape(g, str(g.get("groupName")), count))
    return shapes


def _fits(need: dict[str, float], shape: PodShape) -> bool:
    # Memory is left out (Ray reserves part of the pod for the object store); accelerator tags are check (b).
    return all(shape.resources.get(k, 0.0) + 1e-9 >= v for k, v in need.items()
               if v and k not in ("memory", "object_store_memory") and not str(k).startswith("accelerator_type:"))


def _describe(shapes: list[PodShape]) -> str:
    return "; ".join(f"{s.name}: CPU {'node' if s.resources['CPU'] == math.inf else format(s.resources['CPU'], 'g')}, GPU {s.resources['GPU']:g}" for s in shapes)


def _count(value: Any) -> int:
    """A parallelism degree or host count; anything but a positive int counts as 1 (the schemas report it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def rayline_apps(config: dict | None, add: Add) -> list[tuple[str, ServeConfig]]:
    """(application path, serving Config) of each app `serve.online.app:build_app` builds, read from its `args.config`;
    a config the builder would refuse is reported at the field it names (the app would never start)."""
    found = []
    for i, app in enumerate(_list(_map(config).get("applications"))):
        if _map(app).get("import_path") != BUILDER or not isinstance(_dig(app, "args", "config"), dict):
            continue
        where = f"spec.serveConfigV2.applications[{i}].args.config"
        try:
            found.append((f"spec.serveConfigV2.applications[{i}]", from_dict(ServeConfig, app["args"]["config"], where)))
        except ConfigError as e:
            field, _, why = str(e).removeprefix(f"{where}: ").partition(": ")
            add(f"{where}.{field}", f"{why} ({BUILDER} refuses this serving config: the app would never start)")
    return found


def _rayline_requirements(app_path: str, cfg: ServeConfig) -> list[dict]:
    """rayline's engine (and its ingress, when a separate deployment) in the shape `_requirements` returns."""
    e, where = cfg.engine, f"{app_path}.args.config"
    gpu = e.accelerator == "gpu"
    what = (f"one engine (tensor_parallel_size {e.tensor_parallel_size} x pipeline_parallel_size {e.pipeline_parallel_size}"
            f" GPUs, cpus_per_engine {e.cpus_per_engine:g} each)") if gpu else f"one engine (cpus_per_engine {e.cpus_per_engine:g})"
    reqs = [dict(path=app_path, bundle_path=f"{where}.engine.{'tensor_parallel_size' if gpu else 'cpus_per_engine'}",
                 bundles=placement_bundles(e), strategy=placement_strategy(e), actor={}, what=what,
                 accelerators=[(e.accelerator_type, "args.config.engine.accelerator_type")] if e.accelerator_type else [])]
    if cfg.ingress == "deployment":
        reqs.append(dict(path=app_path, actor_path=f"{where}.ingress_cpus", bundles=[], strategy="", accelerators=[],
                         actor={"CPU": cfg.ingress_cpus}))
    return reqs


def _requirements(config: dict, rayline: list[tuple[str, ServeConfig]]) -> list[dict]:
    """Every deployment / LLM config / rayline engine in a serve config as {path, bundles, strategy, actor, accelerators}."""
    reqs = [r for app_path, cfg in rayline for r in _rayline_requirements(app_path, cfg)]
    for i, app in enumerate(_list(config.get("applications"))):
        app_path = f"spec.serveConfigV2.applications[{i}]"
        for j, dep in enumerate(_list(_dig(app, "deployments"))):
            if not isinstance(dep, dict):
                continue
            opts = _map(dep.get("ray_actor_options"))
            actor = {"CPU": opts.get("num_cpus") or 0, "GPU": opts.get("num_gpus") or 0, **_map(opts.get("resources"))}
            bundles = [b for b in _list(dep.get("placement_group_bundles")) if isinstance(b, dict)]
            accels = [(opts["accelerator_type"], "ray_actor_options.accelerator_type")] if opts.get("accelerator_type") else []
            accels += [(k.split(":", 1)[1], f"ray_actor_options.resources[{k}]") for k in _map(opts.get("resources")) if str(k).startswith("accelerator_type:")]
            accels += [(k.split(":", 1)[1], f"placement_group_bundles[{n}][{k}]") for n, b in enumerate(bundles) for k in b if str(k).startswith("accelerator_type:")]
            reqs.append(dict(path=f"{app_path}.deployments[{j}]", bundle_path=f"{app_path}.deployments[{j}].placement_group_bundles", bundles=bundles,
                             strategy=dep.get("placement_group_strategy") or "PACK", actor=actor, accelerators=accels))
        for k, llm in enumerate(_list(_dig(app, "args", "llm_configs"))):
            if not isinstance(llm, dict):
                continue
            engine, pg = _map(llm.get("engine_kwargs")), _map(llm.get("placement_group_config"))
            devices = _count(engine.get("tensor_parallel_size")) * _count(engine.get("pipeline_parallel_size"))
            bundles = _list(pg.get("bundles")) or [pg.get("bundle_per_worker") or {"GPU": 1}] * devices
            accels = [(llm["accelerator_type"], "accelerator_type")] if llm.get("accelerator_type") else []
            source = "placement_group_config" if pg else "engine_kwargs.tensor_parallel_size"
            reqs.append(dict(path=f"{app_path}.args.llm_configs[{k}]", bundle_path=f"{app_path}.args.llm_configs[{k}].{source}", bundles=[b for b in bundles if isinstance(b, dict)],
                             strategy=pg.get("strategy") or "PACK", actor={}, accelerators=accels))
    return reqs


def _check_placement(reqs: list[dict], shapes: list[PodShape], add: Add) -> None:
    for req in reqs:
        bundles, strategy, where = req["bundles"], str(req["strategy"]).upper(), req.get("bundle_path", req["path"])
        what = f"{req['what']}: " if req.get("what") else ""
        if bundles and strategy == "STRICT_PACK":
            total: dict[str, float] = {}
            for b in bundles:
                for key, v in b.items():
                    total[key] = total.get(key, 0.0) + (float(v) if isinstance(v, (int, float)) else 0.0)
            if not any(_fits(total, s) for s in shapes):
                need = ", ".join(f"{k} {v:g}" for k, v in total.items() if k in ("CPU", "GPU"))
                add(where, f"{what}STRICT_PACK puts all {len(bundles)} bundles on one node ({need}), but no pod offers that ({_describe(shapes)}); the placement group would stay pending")
        elif bundles:
            for n, b in enumerate(bundles):
                need = {k: float(v) for k, v in b.items() if isinstance(v, (int, float))}
                if not any(_fits(need, s) for s in shapes):
                    add(where, f"{what}bundle {n} {b} fits no pod ({_describe(shapes)}); the placement group would stay pending")
            if strategy == "STRICT_SPREAD" and sum(s.count for s in shapes if any(_fits(b, s) for b in bundles)) < len(bundles):
                add(where, f"STRICT_SPREAD needs {len(bundles)} distinct pods, but fewer pods can host these bundles")
        elif req["actor"] and not any(_fits({k: float(v) for k, v in req["actor"].items() if isinstance(v, (int, float))}, s) for s in shapes):
            add(req.get("actor_path", f"{req['path']}.ray_actor_options"), f"a replica needs {req['actor']} but no pod offers that ({_describe(shapes)})")
        for accel, field in req["accelerators"]:
            if not any(accelerator_matches(str(accel), label) for s in shapes for label in s.accelerators):
                add(f"{req['path']}.{field}", f"accelerator_type {accel!r} is on no worker group: add a nodeSelector (nvidia.com/gpu.product, "
                    "cloud.google.com/gke-accelerator) naming it, or the replica waits for a node that never comes")


def engines_that_fit(bundles: list[dict[str, float]], shapes: list[PodShape]) -> float:
    """How many engines of these bundles the pods hold at once, each engine on one pod (math.inf: unbounded)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            if v and k not in ("memory", "object_store_memory") and not str(k).startswith("accelerator_type:"):
                need[k] = need.get(k, 0.0) + float(v)
    total = 0.0
    for s in shapes:
        per_pod = min((math.floor(s.resources.get(k, 0.0) / v + 1e-9) for k, v in need.items()), default=math.inf)
        if per_pod and s.count:
            total += per_pod * s.count
    return total


def _check_rayline_replicas(app_path: str, cfg: ServeConfig, shapes: list[PodShape], add: Add) -> None:
    fit, scaling = engines_that_fit(placement_bundles(cfg.engine), shapes), cfg.autoscaling
    if fit < 1:
        return  # not even one engine fits: _check_placement says so
    start = ("initial_replicas", scaling.initial_replicas) if scaling.initial_replicas is not None else ("min_replicas", scaling.min_replicas)
    for (field, n), outcome in ((start, "the app would never become RUNNING"),
                                (("max_replicas", scaling.max_replicas), f"scaling past {fit:g} replicas would wait forever for a placement group")):
        if n > fit:
            add(f"{app_path}.args.config.autoscaling.{field}", f"{n} engine replicas of {placement_bundles(cfg.engine)} each, but the pods hold "
                f"at most {fit:g} at once ({_describe(shapes)}); {outcome}: lower it or give the worker group more pods (maxReplicas)")
            return


def _number(text: Any) -> float | None:
    """`70B`, `7.5e9`, `350M`, `4096` -> float."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([KMBT]?)\s*", str(text))
    return float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2)] if m else None


def _check_gpu_memory(annotations: dict, config: dict | None, rayline: list[tuple[str, ServeConfig]], add: Add) -> None:
    if "rayline.io/model-params" not in annotations:
        return
    a = {k.removeprefix("rayline.io/"): v for k, v in annotations.items() if str(k).startswith("rayline.io/")}
    llms = [(f"spec.serveConfigV2.applications[{i}].args.llm_configs[{k}]", llm) for i, app in enumerate(_list(_map(config).get("applications")))
            for k, llm in enumerate(_list(_dig(app, "args", "llm_configs"))) if isinstance(llm, dict)]
    llms += [(f"{app_path}.args.config.engine", {"accelerator_type": cfg.engine.accelerator_type, "engine_kwargs": {
        k: getattr(cfg.engine, k) for k in ("max_model_len", "max_num_seqs", "tensor_parallel_size", "gpu_memory_utilization")}, "rayline": True})
        for app_path, cfg in rayline if cfg.engine.accelerator == "gpu"]
    for path, llm in llms or [("metadata.annotations[rayline.io/model-params]", {})]:
        engine = _map(llm.get("engine_kwargs"))
        gib = a.get("gpu-memory-gib") or GPU_MEMORY_GIB.get(str(llm.get("accelerator_type", "")).upper())
        values = {"params": a.get("model-params"), "num_layers": a.get("model-layers"), "num_kv_heads": a.get("model-kv-heads"),
                  "head_dim": a.get("model-head-dim"), "dtype_bytes": a.get("model-dtype-bytes", 2),
                  "max_model_len": engine.get("max_model_len", a.get("max-model-len")), "max_num_seqs": engine.get("max_num_seqs", a.get("max-num-seqs", 256)),
                  "tensor_parallel_size": engine.get("tensor_parallel_size", a.get("tensor-parallel-size", 1)), "gpu_memory_bytes": gib}
        missing = [k for k, v in values.items() if v is None or _number(v) is None]
        if missing:
            add(path, f"GPU memory check needs {', '.join(missing)}: set the rayline.io/ annotations listed in rayjobs/preflight.py")
            continue
        args = {k: int(_number(v) * (GIB if k == "gpu_memory_bytes" else 1)) for k, v in values.items()}
        try:
            util = float(engine.get("gpu_memory_utilization", a.get("gpu-memory-utilization", 0.9)))
            ok, why = gpu_fit(**args, gpu_memory_utilization=util)
        except ValueError as e:
            add(path, str(e))
            continue
        if not ok:
            add(f"{path}.engine_kwargs" if llm and not llm.get("rayline") else path, f"model does not fit GPU memory: {why}")


def check_preflight(doc: dict) -> list[Problem]:
    """rayline's preflight (a)-(g) for one manifest as written (before CRD defaults)."""
    problems: list[Problem] = []

    def add(path: str, message: str) -> None:
        problems.append(Problem(path, message, LAYER))

    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    annotations = _dig(doc, "metadata", "annotations")
    annotations = annotations if isinstance(annotations, dict) else {}
    cluster, base = cluster_spec_of(doc)
    config = load_serve_config(spec) if doc.get("kind") == "RayService" else None
    rayline = rayline_apps(config, add)
    if cluster is not None:
        shapes = pod_shapes(cluster)
        reqs = _requirements(config, rayline) if config else []
        if doc.get("kind") == "RayJob" and (spec.get("entrypointNumCpus") or spec.get("entrypointNumGpus")):
            reqs.append(dict(path="spec", bundles=[], strategy="", accelerators=[],
                             actor={"CPU": spec.get("entrypointNumCpus") or 0, "GPU": spec.get("entrypointNumGpus") or 0}))
        _check_placement(reqs, shapes, add)
        for app_path, cfg in rayline:
            _check_rayline_replicas(app_path, cfg, shapes, add)
        check_exposure(doc, cluster, base, add)
        for i, g in enumerate(_list(cluster.get("workerGroupSpecs"))):
            lo, hi, n = _dig(g, "minReplicas"), _dig(g, "maxReplicas"), _dig(g, "replicas")
            if all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi, n)) and not lo <= n <= hi:
                add(f"{base}.workerGroupSpecs[{i}].replicas", f"replicas {n} is outside [minReplicas {lo}, maxReplicas {hi}]; the operator silently clamps it")
    _check_gpu_memory(annotations, config, rayline, add)
    check_secrets(spec, "spec", add)
    for field, parsed in (("runtimeEnvYAML", spec.get("runtimeEnvYAML")), ("serveConfigV2", config)):
        if isinstance(parsed, str):
            try:
                parsed = yaml.safe_load(parsed)
            except yaml.YAMLError:
                parsed = None
        if isinstance(parsed, dict):
            check_secrets(parsed, f"spec.{field}", add)
    return problems
