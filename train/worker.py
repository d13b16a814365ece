"""What each Ray Train worker runs: restore, train with the shared loop, checkpoint through Ray, export.

`train_fn_per_worker(config)` is the TorchTrainer's `train_loop_per_worker`. Its config holds the
TrainConfig (as a dict), the driver's RunPlan and the MLflow run id. Data comes from the worker's
dataset shards; checkpoints are DCP directories reported with `ray.train.report`, which Ray Train
merges across ranks into `<run_uri>/checkpoint_step<N>/` and keeps `num_to_keep` of. A node's termination
notice (Ray Train's preemption info) makes the ranks checkpoint at once when the save fits (train/notice.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from dataclasses import replace
from typing import Callable

from core.collector import heavy_imports, preload

with heavy_imports():  # a worker's start is mostly these imports (core/collector.py)
    import torch
    import torch.distributed as dist

from core import metrics as metrics_api
from core import storage
from core.config import from_dict
from train.checkpoint import (
    COMMITTED,
    TrainerState,
    checkpoint_files,
    checkpoint_name,
    latest_complete_checkpoint,
    load_checkpoint,
    mark_committed,
    save_checkpoint,
)
from train.batches import GlobalOrderBatches, ShardBatches
from train.config import TrainConfig
from train.export import export_model
from train.fsdp import build_sharded_model
from train.loop import TOKEN_CROSS_ENTROPY, LoopPlan, all_ranks, rank_values, train_loop
from train.mfu import mfu, peak_flops, train_flops_per_token
from train.notice import Decision, Notice, NoticeSaver, SaveTimes
from train.optimizer import adam_state_summary, build_optimizer
from train.preflight import RunPlan
from train.step_hook import load_step_hook
from train.tracking import MetricLogger


class RayHooks:
    """LoopHooks: step metrics to MLflow (rank 0), checkpoints and their metrics to Ray Train (all ranks).

    The last checkpoint of a run is taken after the export and records it, so a restart after that
    point neither trains nor exports again.
    """

    def __init__(self, model, optimizer, logger: MetricLogger, rank: int, total_steps: int,
                 export: Callable[[TrainerState], str], tags: dict[str, str] | None = None,
                 flops_per_token: int = 0, peak_flops: float | None = None, world: int = 1,
                 run_uri: str = "", save_times: SaveTimes | None = None):
        self.model, self.optimizer, self.logger, self.rank = model, optimizer, logger, rank
        self.total_steps, self.export, self.run_uri = total_steps, export, run_uri
        self.save_times = save_times or SaveTimes()
        self.tags = tags or {"run": "", "model": ""}
        self.flops_per_token, self.peak, self.world = flops_per_token, peak_flops, world
        self.root = Path(tempfile.mkdtemp(prefix=f"rayline-ckpt-r{rank}-"))
        self.started = time.perf_counter()
        self.first_step: int | None = None

    def on_step(self, state: TrainerState, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        utilization = mfu(self.flops_per_token, metrics["tokens_per_s"], self.world, self.peak)
        self.logger.log(state.step, {**metrics, "workers": float(self.world),
                                     **({"mfu": utilization} if utilization is not None else {})})
        for name, key in (("rayline_train_loss", "loss"), ("rayline_train_tokens_per_second", "tokens_per_s"),
                          ("rayline_train_step_seconds", "step_time_s")):
            metrics_api.gauge(name, metrics[key], **self.tags)
        if utilization is not None:
            metrics_api.gauge("rayline_train_mfu_ratio", utilization, **self.tags)
        metrics_api.gauge("rayline_train_step", state.step, **self.tags)
        if state.step % max(1, self.total_steps // 20) == 0 or state.step == self.total_steps:
            print(progress_line(state.step, self.total_steps, metrics, self.started, self.first_step), flush=True)

    def on_start(self, state: TrainerState) -> None:
        if self.rank == 0:
            self.first_step = state.step
            metrics_api.gauge("rayline_train_steps_planned", self.total_steps, **self.tags)
            metrics_api.gauge("rayline_train_step", state.step, **self.tags)

    def on_eval(self, state: TrainerState, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            self.logger.log(state.step, metrics)
            metrics_api.gauge("rayline_train_eval_loss", metrics["eval_loss"], **self.tags)
            print(f"step {state.step}: eval_loss {metrics['eval_loss']:.4f}", flush=True)

    def on_checkpoint(self, state: TrainerState, metrics: dict[str, float]) -> None:
        if state.step >= self.total_steps and state.exported_step != state.step:
            state.export_uri, state.exported_step = self.export(state), state.step
            if self.rank == 0:
                self.logger.log(state.step, {"exported": 1.0})
        t0 = time.perf_counter()
        state.save_seconds = self.save_times.recent  # rank 0's go into the checkpoint, for a resumed run's estimate
        report_checkpoint(self.model, self.optimizer, state, metrics, self.rank, self.root, self.logger, self.run_uri)
        seconds = time.perf_counter() - t0
        self.save_times.add(seconds)
        if self.rank == 0:
            metrics_api.gauge("rayline_train_checkpoint_save_seconds", seconds, **self.tags)

    def on_notice(self, step: int, notice: Notice, decision: Decision, saved: bool) -> None:
        """A termination notice, as an event in the run: the time it left, what a save needed, whether one was
        taken (rank 0 logs it; the save's own duration follows as notice/save_s)."""
        self.logger.log(step, {"notice/seconds_left": decision.left_s, "notice/save_needed_s": decision.needed_s,
                               "notice/saved": 1.0 if saved else 0.0})
        self.logger.flush()

    def on_notice_saved(self, state: TrainerState) -> None:
        self.logger.log(state.step, {"notice/save_s": self.save_times.recent[-1]})
        self.logger.flush()


def progress_line(step: int, total: int, metrics: dict[str, float], started: float, first_step: int | None) -> str:
    """`step 40/200 (20%) loss 1.2345, 812 tok/s, ETA 3m12s` from the steps this process has taken so far."""
    done = step - (first_step or 0)
    elapsed = time.perf_counter() - started
    eta = ""
    if done > 0 and step < total:
        left = elapsed / done * (total - step)
        eta = f", ETA {int(left // 60)}m{int(left % 60):02d}s"
    return (f"step {step}/{total} ({100 * step // max(total, 1)}%) loss {metrics['loss']:.4f}, "
            f"{metrics['tokens_per_s']:,.0f} tok/s{eta}")


def report_checkpoint(model, optimizer, state: TrainerState, metrics: dict, rank: int, root: Path,
                      logger: MetricLogger, run_uri: str = "") -> None:
    """Save this rank's part of a DCP checkpoint, report it, and (rank 0, once every rank's upload has returned)
    commit it in storage under `run_uri` (train/checkpoint.py COMMITTED)."""
    import ray.train

    name = checkpoint_name(state.step)
    local = root / name
    save_checkpoint(local, model, optimizer, state, rank)
    fingerprint = adam_state_summary(optimizer)
    if rank == 0:
        logger.log(state.step, {f"checkpoint/{k}": v for k, v in fingerprint.items()})
        logger.flush()  # every step up to this checkpoint is in MLflow before a restart could resume past it
    report = {"step": state.step, "epoch": state.epoch, "eval_loss": state.eval_loss,
              "first_eval_loss": state.first_eval_loss, "loss": metrics.get("loss"), "tokens_seen": state.tokens_seen,
              "train_time_s": state.train_time_s, "wall_time_s_ranks": rank_values(state.wall_time_s),
              "export_uri": state.export_uri or "", **state.eval_metrics, **fingerprint,
              # What this worker computes with, read back in it (bench/bench_train.py compares it with torchrun's).
              "torch_threads": torch.get_num_threads(),
              "backend": dist.get_backend() if dist.is_initialized() else "none"}
    ray.train.report({k: v for k, v in report.items() if v is not None},
                     checkpoint=ray.train.Checkpoint.from_directory(str(local)), checkpoint_dir_name=name,
                     delete_local_checkpoint_after_upload=True)
    if run_uri:
        commit_checkpoint(storage.join(run_uri, name), state.step, rank)


def commit_checkpoint(uri: str, step: int, rank: int) -> None:
    """Collective, after every rank's `ray.train.report` of the checkpoint at `uri`: rank 0 writes its commit marker
    once every rank's files are in storage. Each rank's report returns after its own upload; a report Ray skipped
    (a rank lost meanwhile) leaves files missing, and no marker."""
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    missing = checkpoint_files(world) - {COMMITTED} - set(storage.list_files(uri))
    if missing:
        print(f"warning: {uri} is missing {sorted(missing)} after every rank reported it; not committed", flush=True)
        return
    mark_committed(uri, step, world)


def _model_dir(plan: RunPlan, local_rank: int) -> str:
    """A local directory with the base model (downloaded once per node when it lives in S3)."""
    if not storage.is_remote(plan.model_uri):
        return storage.resolve(plan.model_uri)[1]
    cache = Path(tempfile.gettempdir()) / "rayline-models"
    if local_rank == 0:
        storage.local_copy(plan.model_uri, cache)
    dist.barrier()
    return storage.local_copy(plan.model_uri, cache)


def _resume_checkpoint(registered, run_uri: str, rank: int, world: int):
    """Ray Train's latest registered checkpoint, or a newer complete one it had not registered yet.

    Rank 0 looks and tells the others, so every rank resumes from the same step even if a checkpoint
    completes in storage while they start."""
    import ray.train

    found = [latest_complete_checkpoint(run_uri, world) if rank == 0 else None]
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(found, src=0)
    newest = found[0]
    if newest is None or (registered is not None and Path(registered.path).name >= newest):
        return registered
    fs, path = storage.resolve(storage.join(run_uri, newest))
    return ray.train.Checkpoint(path=path, filesystem=fs)


def rank_zero_print(rank: int) -> Callable[[str], None]:
    """Print on rank 0 only: every rank takes the same decisions, and the driver's log needs them once."""
    return (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)


def ray_notice() -> Notice | None:
    """Ray Train's preemption info for this worker group as a Notice (None: no node of the run is going). A collective:
    Ray broadcasts rank 0's view, so every rank sees the same notice at the same step."""
    import ray.train

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    return Notice(deadline_s=info.deadline_ms / 1000 if info.deadline_ms else None,
                  nodes=tuple(info.preempted_node_ids), ranks=tuple(info.preempted_ranks))


def sized_loop(loop: LoopPlan, world: int) -> LoopPlan:
    """The plan at `world` workers: an elastic run keeps its global batch, accumulating more micro-batches on fewer."""
    if not loop.global_batch_rows:
        return loop
    return replace(loop, grad_accum_steps=loop.global_batch_rows // (loop.rows_per_micro_batch * world))


def resize_state(state: TrainerState, loop: LoopPlan, world: int) -> int:
    """Carry an elastic run's data position from the size that wrote `state` to `world` workers (the steps taken in
    the epoch stay; each stands for another count of micro-batches per worker). Returns the old size."""
    old = state.world_size
    steps_in = state.micro_batches_into_epoch // sized_loop(loop, old).grad_accum_steps
    state.micro_batches_into_epoch = steps_in * sized_loop(loop, world).grad_accum_steps
    state.world_size = world
    return old


def resize_record(old: int, step: int, run_id: str | None, world: int) -> dict[str, float]:
    """What a resize cost, as metrics at the step it resumed from: the sizes before and after, and the steps the run
    had taken beyond that checkpoint before the group stopped (logged to MLflow, so redone now)."""
    lost = 0
    if run_id:
        from core import registry

        taken = [m.step for m in registry.client().get_metric_history(run_id, "loss")]
        lost = max(0, max(taken, default=step) - step)
    print(f"resized from {old} to {world} workers at step {step} ({lost} steps to redo)", flush=True)
    return {"resize/from_workers": float(old), "resize/to_workers": float(world), "resize/steps_lost": float(lost)}


def train_fn_per_worker(config: dict) -> None:
    # The model's code, in the worker only: the driver imports this module too, and needs no transformers.
    preload("ray.train.torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
    import ray.train
    import ray.train.torch

    cfg = from_dict(TrainConfig, config["cfg"], "train_loop_config")
    plan = RunPlan.from_dict(config["plan"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # One thread per worker: fractional-CPU workers share cores, and results stay bit-for-bit repeatable.
        torch.set_num_threads(max(1, int(plan.resources_per_worker.get("CPU", 1))))
    torch.manual_seed(cfg.train.seed)

    model_dir = _model_dir(plan, ctx.get_local_rank())
    model = build_sharded_model(model_dir, device, cfg.model.attn_implementation,
                                cfg.model.activation_checkpointing, cfg.bf16, cfg.lora, plan.base_model_ref,
                                cfg.model.fsdp_unit)
    optimizer, scheduler = build_optimizer(model, cfg.optim, plan.total_steps)
    logger = MetricLogger(config.get("mlflow_run_id") if rank == 0 else None)

    loop = sized_loop(plan.loop, world)
    state = TrainerState(world_size=world, global_batch_rows=plan.loop.global_batch_rows)
    checkpoint = _resume_checkpoint(ray.train.get_checkpoint(), plan.run_uri, rank, world)
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            state = load_checkpoint(ckpt_dir, model, optimizer, scheduler, rank, plan.loop.global_batch_rows)
        resumed = {"resume/step": state.step, **{f"resume/{k}": v for k, v in adam_state_summary(optimizer).items()}}
        if state.world_size != world:
            resized = resize_state(state, plan.loop, world)
            torch.manual_seed(cfg.train.seed + state.step)  # the per-rank RNG states were not loaded: reseed them
            if rank == 0:
                resumed.update(resize_record(resized, state.step, config.get("mlflow_run_id"), world))
        if rank == 0:
            logger.log(state.step, resumed)
            print(f"resumed from {checkpoint.path} at step {state.step} on {world} workers (epoch {state.epoch}, "
                  f"{state.micro_batches_into_epoch} micro-batches in)", flush=True)

    export_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.export.dtype, torch.bfloat16 if cfg.bf16 else torch.float32)

    def export(final: TrainerState) -> str:
        info = {"run_name": cfg.run_name, "step": final.step, "dataset_version": plan.dataset_version,
                "dataset_manifest": plan.manifest_uri, "base_model": plan.base_model_ref,
                "mlflow_run_id": config.get("mlflow_run_id"), "eval_loss": final.eval_loss}
        return export_model(model, model_dir, plan.export_uri, export_dtype, info, rank)

    tags = {"run": config.get("mlflow_run_id") or cfg.run_name, "model": cfg.mlflow.register_as or cfg.run_name}
    save_times = SaveTimes(state.save_seconds, cfg.checkpoint.save_estimate_s)
    hooks = RayHooks(model, optimizer, logger, rank, plan.total_steps, export, tags, train_flops_per_token(model),
                     peak_flops(device, torch.bfloat16 if cfg.bf16 else torch.float32) if rank == 0 else None, world,
                     plan.run_uri, save_times)
    notice = None
    if cfg.checkpoint.save_on_notice:
        notice = NoticeSaver(ray_notice, save_times, cfg.checkpoint.notice_grace_s, cfg.checkpoint.notice_margin_s,
                             agree=lambda fits: all_ranks(fits, device), report=hooks.on_notice,
                             on_saved=hooks.on_notice_saved, log=rank_zero_print(rank))
    if checkpoint is not None and rank == 0:
        metrics_api.inc("rayline_train_restarts", 1, **tags)
    hooks.on_start(state)
    # The objective travels pickled in the config (posttrain's DPO loss); without one, next-token cross-entropy.
    objective = config.get("objective") or TOKEN_CROSS_ENTROPY
    shards = (ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("eval"), cfg, device,
              objective.batch_dtypes)
    source = (GlobalOrderBatches(*shards, rank, world, loop.global_batch_rows, loop.steps_per_epoch)
              if loop.global_batch_rows else ShardBatches(*shards))
    mask_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    try:
        train_loop(model, optimizer, scheduler, source, loop, state, hooks, device, mask_dtype,
                   after_step=load_step_hook(rank, world), objective=objective, notice=notice)
    finally:
        logger.flush()
        shutil.rmtree(hooks.root, ignore_errors=True)  # the staging folder; each checkpoint left it once uploaded
    if rank == 0:
        metrics_api.flush()  # the worker is killed when this returns: its final step must reach Prometheus
