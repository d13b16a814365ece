"""Checks that need the dataset, the base model or the cluster, and the run plan they produce.

`plan_run(cfg)` runs on the driver before any training worker starts. It raises `ConfigError` naming
the config field at fault (a missing dataset, a batch larger than the data, a model that does not
exist, workers that cannot fit, a fixed-size resume with another worker count than the checkpoints were
written by) and otherwise returns the `RunPlan` the workers run by.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from data.prepared import load_manifest
from core import registry, storage
from core.config import ConfigError
from train.capacity import runs_that_fit
from train.checkpoint import WorldSizeMismatch, check_resumable, newest_trainer_state
from train.config import TrainConfig
from train.lora import check_target_modules
from train.loop import LoopPlan


@dataclass
class RunPlan:
    manifest_uri: str
    dataset_version: str
    seq_len: int
    train_rows: int
    eval_rows: int
    model_uri: str
    """The base model's files: a local directory or s3:// URI (a `models:/` reference resolved)."""
    resources_per_worker: dict[str, float]
    steps_per_epoch: int
    total_steps: int
    loop: LoopPlan
    run_uri: str
    """`<storage_path>/<run_name>`: Ray Train's run directory, checkpoints inside it."""
    export_uri: str
    base_model_ref: str = ""
    """The base model as lineage names it: `models:/NAME/VERSION` (an alias resolved to its version) or the path."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunPlan":
        return cls(**{**data, "loop": LoopPlan(**data["loop"])})


def _absolute(uri: str) -> str:
    """Local paths made absolute (Ray Train workers run in their own working directory); URIs unchanged."""
    return uri if storage.is_remote(uri) else storage.resolve(uri)[1]


def _newest_version(root: str) -> str | None:
    """The manifest of the newest prepared version under a data stage `output_uri`, if any."""
    import pyarrow.fs as pafs

    fs, path = storage.resolve(root)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    found = []
    for info in infos:
        uri = storage.join(root, info.base_name, "manifest.json")
        if info.type == pafs.FileType.Directory and storage.exists(uri):
            found.append((load_manifest(uri).get("created_at", ""), uri))
    return max(found)[1] if found else None


def _manifest(cfg: TrainConfig) -> tuple[str, dict]:
    """Accepts a manifest.json URI, a version directory, or the data stage's output_uri (newest version)."""
    uri = _absolute(cfg.data.manifest_uri.rstrip("/"))
    if not uri.endswith(".json"):
        direct = storage.join(uri, "manifest.json")
        uri = direct if storage.exists(direct) else (_newest_version(uri) or direct)
    try:
        return uri, load_manifest(uri)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.manifest_uri: {e}") from None


def _model(cfg: TrainConfig) -> tuple[str, dict, str]:
    """The base model's files, its config.json, and its exact reference (an alias resolved to its version)."""
    ref = cfg.model.path
    try:
        uri = _absolute(registry.resolve_model_uri(ref))
        if ref.startswith("models:/"):
            mv = registry.get_version(ref)
            ref = f"models:/{mv.name}/{mv.version}"
    except (LookupError, ValueError) as e:
        raise ConfigError(f"model.path: {e}") from None
    config_uri = storage.join(uri, "config.json")
    try:
        return uri, json.loads(storage.read_text(config_uri)), ref
    except FileNotFoundError:
        raise ConfigError(f"model.path: {ref}: no Hugging Face model there ({config_uri} not found)") from None


def plan_run(cfg: TrainConfig, cluster: dict[str, float]) -> RunPlan:
    """Validate `cfg` against its dataset, model and `cluster` (ray.cluster_resources()); return the plan."""
    manifest_uri, manifest = _manifest(cfg)
    splits = manifest.get("splits", {})
    for split in ("train", "eval"):
        if split not in splits:
            raise ConfigError(f"data.manifest_uri: {manifest_uri} has no {split!r} split")
    seq_len = int(manifest["seq_len"])
    train_rows, eval_rows = int(splits["train"]["rows"]), int(splits["eval"]["rows"])
    t, sc = cfg.train, cfg.scaling
    n = sc.max_workers
    global_batch = t.micro_batch_size * t.grad_accum_steps * n
    if sc.elastic:
        # Every size the run may take must cut the same global batch into whole micro-batches per worker.
        for w in range(sc.min_workers, sc.max_workers + 1):
            if global_batch % (t.micro_batch_size * w):
                raise ConfigError(
                    f"train.grad_accum_steps: the global batch of micro_batch_size {t.micro_batch_size} x "
                    f"grad_accum_steps {t.grad_accum_steps} x {n} workers = {global_batch} rows does not split into "
                    f"micro-batches over {w} workers, a size scaling.num_workers {list(sc.num_workers)} allows; "
                    f"make it a multiple of micro_batch_size x every size in the range")
        if global_batch > train_rows:
            raise ConfigError(
                f"train.micro_batch_size: one step takes micro_batch_size {t.micro_batch_size} x grad_accum_steps "
                f"{t.grad_accum_steps} x {n} workers = {global_batch} rows, but the train split of {manifest_uri} "
                f"has {train_rows} rows; lower the batch or the worker count")
        # Every worker reads the whole train split in one order and takes its rows of each step (train/batches.py).
        steps_per_epoch = train_rows // global_batch
    else:
        # Ray splits each split evenly over the workers, dropping the remainder rows.
        rows_per_worker = train_rows // n
        rows_per_step = t.micro_batch_size * t.grad_accum_steps
        if rows_per_step > rows_per_worker:
            raise ConfigError(
                f"train.micro_batch_size: one step takes micro_batch_size {t.micro_batch_size} x grad_accum_steps "
                f"{t.grad_accum_steps} x num_workers {n} = {rows_per_step * n} rows, but the train split of "
                f"{manifest_uri} has {train_rows} rows; lower the batch or the worker count"
            )
        steps_per_epoch = rows_per_worker // rows_per_step
    if eval_rows < n:
        raise ConfigError(f"data.manifest_uri: the eval split of {manifest_uri} has {eval_rows} rows, fewer than "
                          f"scaling.num_workers {n}; every worker needs eval rows")
    total_steps = t.max_steps or t.epochs * steps_per_epoch

    model_uri, model_config, base_model_ref = _model(cfg)
    if cfg.lora.enabled:
        check_target_modules(model_config, cfg.lora.target_modules)
    max_pos = model_config.get("max_position_embeddings")
    if max_pos and seq_len > max_pos:
        raise ConfigError(f"data.manifest_uri: rows of {seq_len} tokens exceed {cfg.model.path}'s "
                          f"max_position_embeddings {max_pos}")
    data_vocab = (manifest.get("tokenizer") or {}).get("vocab_size")
    model_vocab = model_config.get("vocab_size")
    if data_vocab and model_vocab and data_vocab > model_vocab:
        raise ConfigError(f"model.path: {cfg.model.path} has {model_vocab} token embeddings but the dataset was "
                          f"tokenized with {data_vocab} tokens ({manifest['tokenizer'].get('name_or_path')})")

    try:
        storage.resolve(cfg.checkpoint.storage_path)
    except ValueError as e:
        raise ConfigError(f"checkpoint.storage_path: {e}") from None
    resources = cfg.scaling.worker_resources(float(cluster.get("CPU", 0)))
    if resources.get("CPU", 1) <= 0:
        raise ConfigError(f"scaling.data_cpus: the cluster has {cluster.get('CPU', 0):g} CPU and data_cpus keeps "
                          f"{cfg.scaling.data_cpus:g} for Ray Data, leaving none for {n} workers")
    fit = runs_that_fit(cluster, sc.min_workers, resources, cfg.scaling.data_cpus)  # an elastic run starts at min
    if fit.runs < 1:
        raise ConfigError(f"scaling.resources_per_worker: {resources} per worker does not fit on this cluster: "
                          f"{fit.explain(1)}")

    eval_every = t.eval_every_steps or steps_per_epoch
    loop = LoopPlan(
        total_steps=total_steps, steps_per_epoch=steps_per_epoch, grad_accum_steps=t.grad_accum_steps,
        eval_every_steps=eval_every, checkpoint_every_steps=t.checkpoint_every_steps or eval_every,
        log_every_steps=t.log_every_steps, grad_clip=cfg.optim.grad_clip, rows_per_micro_batch=t.micro_batch_size,
        seq_len=seq_len, global_batch_rows=global_batch if sc.elastic else 0,
    )
    run_uri = storage.join(_absolute(cfg.checkpoint.storage_path), cfg.run_name)
    saved = newest_trainer_state(run_uri)
    if saved is not None:
        try:
            check_resumable(saved[1], n, saved[0], loop.global_batch_rows, elastic=sc.elastic)
        except WorldSizeMismatch as e:
            raise ConfigError(f"scaling.num_workers: run {cfg.run_name} resumes from {e}") from None
    return RunPlan(
        manifest_uri=manifest_uri, dataset_version=str(manifest.get("version", "unknown")), seq_len=seq_len,
        train_rows=train_rows, eval_rows=eval_rows, model_uri=model_uri, resources_per_worker=resources,
        steps_per_epoch=steps_per_epoch, total_steps=total_steps, loop=loop, run_uri=run_uri,
        export_uri=storage.join(run_uri, "export"), base_model_ref=base_model_ref,
    )
