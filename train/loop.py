"""The training loop itself, shared by Ray Train workers and the torchrun baseline of the benchmark.

It knows nothing of Ray: batches come from a `BatchSource`, and metrics, eval results and
checkpoints go out through `LoopHooks`. The loss of a step is the sum of token losses over every
micro-batch on every rank divided by the step's global count of loss tokens, so results do not depend
on how the global batch is cut into ranks and micro-batches.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist

from train.checkpoint import TrainerState
from train.packed_batch import forward_loss_sum, loss_tokens

Batch = dict[str, torch.Tensor]


class BatchSource(Protocol):
    def train_batches(self, epoch: int) -> Iterable[Batch]:
        """This rank's micro-batches of one epoch, the same sequence every time for the same epoch."""

    def eval_batches(self) -> Iterable[Batch]:
        """This rank's share of the eval split."""


class Objective(Protocol):
    """What a step minimises: the summed loss of a micro-batch and what that sum is averaged over (loss tokens for
    SFT, preference pairs for DPO: posttrain/dpo_loss.py), with the dtypes its batches are read in, and what else an
    evaluation measures beside the loss (`eval_metrics`, summed by `eval_sums` and averaged the same way)."""

    batch_dtypes: torch.dtype | dict[str, torch.dtype]
    eval_metrics: tuple[str, ...]
    """Names of the other quantities an evaluation reports, as `eval_<name>` (DPO: the preference accuracy)."""

    def loss_sum(self, model: torch.nn.Module, batch: Batch, device: torch.device,
                 mask_dtype: torch.dtype) -> torch.Tensor: ...

    def eval_sums(self, model: torch.nn.Module, batch: Batch, device: torch.device,
                  mask_dtype: torch.dtype) -> dict[str, torch.Tensor | float]:
        """`loss` (as loss_sum) and each of `eval_metrics`, summed over the batch, from one forward pass."""

    def count(self, batch: Batch) -> int: ...


class TokenCrossEntropy:
    """Next-token cross-entropy over the labelled tokens of packed rows: the SFT and pre-training objective."""

    batch_dtypes = torch.int64
    eval_metrics = ()

    def loss_sum(self, model, batch, device, mask_dtype):
        return forward_loss_sum(model, batch, device, mask_dtype)

    def eval_sums(self, model, batch, device, mask_dtype):
        return {"loss": self.loss_sum(model, batch, device, mask_dtype)}

    def count(self, batch):
        return loss_tokens(batch)


TOKEN_CROSS_ENTROPY = TokenCrossEntropy()


class LoopHooks(Protocol):
    def on_step(self, state: TrainerState, metrics: dict[str, float]) -> None: ...

    def on_eval(self, state: TrainerState, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, state: TrainerState, metrics: dict[str, float]) -> None: ...


class StepNotice(Protocol):
    """A node's termination notice, asked at every step boundary (train/notice.py NoticeSaver)."""

    def save_now(self, state: TrainerState) -> bool:
        """Collective: whether a notice asks for a checkpoint of this step (one that fits before the node goes)."""

    def saved(self, state: TrainerState) -> None:
        """After that checkpoint: returns only if training is to go on."""


@dataclass
class LoopPlan:
    """The numbers the loop runs by, fixed on the driver from the dataset's manifest."""

    total_steps: int
    steps_per_epoch: int
    grad_accum_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    log_every_steps: int = 1
    grad_clip: float = 1.0
    rows_per_micro_batch: int = 1
    seq_len: int = 1
    global_batch_rows: int = 0
    """An elastic run's rows per step, kept at every size (`grad_accum_steps` is then set per size: train/worker.py
    sized_loop); 0 for a fixed-size run."""


def _global_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device, mask_dtype: torch.dtype,
             objective: Objective = TOKEN_CROSS_ENTROPY) -> dict[str, float]:
    """`eval_loss` and `eval_<name>` of each of the objective's `eval_metrics`: means (per token, or per what
    `objective` counts) over every rank's eval batches."""
    names = ("loss", *objective.eval_metrics)  # the same order on every rank, even one without eval batches
    sums, count = [0.0] * len(names), 0
    model.eval()
    for batch in batches:
        parts = objective.eval_sums(model, batch, device, mask_dtype)
        sums = [total + float(parts[name]) for total, name in zip(sums, names)]
        count += objective.count(batch)
    model.train()
    *totals, total_count = _global_sum([*sums, float(count)], device)
    return {f"eval_{name}": total / max(total_count, 1.0) for name, total in zip(names, totals)}


def _record_eval(state: TrainerState, metrics: dict[str, float]) -> dict[str, float]:
    """Keep an evaluation's results in the state (what checkpoints report); returns them."""
    state.eval_loss = metrics["eval_loss"]
    state.eval_metrics = {k: v for k, v in metrics.items() if k != "eval_loss"}
    return metrics


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True when `flag` is True on every rank (a collective: every rank calls it at the same point)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def rank_values(value: float) -> list[float]:
    """`value` as every rank holds it, by rank (a collective: every rank calls it at the same point)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _micro_batches(source: BatchSource, state: TrainerState, plan: LoopPlan) -> Iterator[tuple[int, Batch]]:
    """(epoch, batch) from the saved data position on; stops an epoch at its last whole step."""
    per_epoch = plan.steps_per_epoch * plan.grad_accum_steps
    epoch, skip = state.epoch, state.micro_batches_into_epoch
    while True:
        taken = 0
        # islice stops at the epoch's last whole step without pulling one batch too many.
        for i, batch in enumerate(itertools.islice(source.train_batches(epoch), per_epoch)):
            if i < skip:
                continue  # already trained on before the checkpoint this run resumed from
            taken += 1
            yield epoch, batch
        if taken == 0 and skip == 0:
            raise RuntimeError(f"epoch {epoch}: the train split gave this rank no batches")
        epoch, skip = epoch + 1, 0


def train_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, source: BatchSource, plan: LoopPlan,
               state: TrainerState, hooks: LoopHooks, device: torch.device, mask_dtype: torch.dtype = torch.float32,
               after_step: Callable[[int], None] | None = None,
               objective: Objective = TOKEN_CROSS_ENTROPY, notice: StepNotice | None = None) -> TrainerState:
    """Train from `state.step` to `plan.total_steps` on `objective` (default: next-token cross-entropy); returns the
    final state (also passed to the hooks). With `notice`, a node's termination notice makes the step boundary it is
    seen at take a checkpoint (unless one was just taken), after the step's eval and periodic checkpoint."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_epoch = plan.steps_per_epoch * plan.grad_accum_steps
    if state.step == 0 and state.eval_loss is None:
        evaluated = _record_eval(state, evaluate(model, source.eval_batches(), device, mask_dtype, objective))
        state.first_eval_loss = state.eval_loss
        hooks.on_eval(state, evaluated)
    stream = _micro_batches(source, state, plan) if state.step < plan.total_steps else iter(())
    last_end = None  # when the previous step ended: state.wall_time_s runs from step end to step end
    while state.step < plan.total_steps:
        t0 = time.perf_counter()
        last_end = t0 if last_end is None else last_end
        micro = [next(stream) for _ in range(plan.grad_accum_steps)]
        local_tokens = sum(objective.count(b) for _, b in micro)
        (global_tokens,) = _global_sum([float(local_tokens)], device)
        loss_sum = 0.0
        for i, (_, batch) in enumerate(micro):
            last = i == len(micro) - 1
            if hasattr(model, "set_requires_gradient_sync"):
                # Gradients are reduce-scattered once per step, on the last micro-batch.
                model.set_requires_gradient_sync(last)
            loss = objective.loss_sum(model, batch, device, mask_dtype)
            # FSDP averages gradients over ranks; scaling by world size makes the result sum/global_tokens.
            (loss * world / max(global_tokens, 1.0)).backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        (step_loss,) = _global_sum([loss_sum], device)

        # A step never spans two epochs: each epoch is cut at its last whole step.
        epoch = micro[-1][0]
        consumed = (state.micro_batches_into_epoch if epoch == state.epoch else 0) + plan.grad_accum_steps
        state.step += 1
        state.epoch, state.micro_batches_into_epoch = (epoch + 1, 0) if consumed >= per_epoch else (epoch, consumed)
        step_rows = plan.rows_per_micro_batch * plan.grad_accum_steps * world
        state.tokens_seen += step_rows * plan.seq_len
        end = time.perf_counter()
        step_time = end - t0
        state.train_time_s += step_time
        state.wall_time_s += end - last_end
        last_end = end
        metrics = {"loss": step_loss / max(global_tokens, 1.0), "lr": lr, "grad_norm": grad_norm,
                   "step_time_s": step_time, "tokens_per_s": step_rows * plan.seq_len / step_time,
                   "loss_tokens": global_tokens, "epoch": float(state.epoch)}
        if state.step % plan.log_every_steps == 0 or state.step == plan.total_steps:
            hooks.on_step(state, metrics)
        if after_step is not None:
            after_step(state.step)

        done = state.step == plan.total_steps
        end_of_epoch = state.micro_batches_into_epoch == 0
        eval_due = (state.step % plan.eval_every_steps == 0) if plan.eval_every_steps else end_of_epoch
        if eval_due or done:
            hooks.on_eval(state, _record_eval(state, evaluate(model, source.eval_batches(), device, mask_dtype, objective)))
        ckpt_due = (state.step % plan.checkpoint_every_steps == 0) if plan.checkpoint_every_steps else eval_due
        if ckpt_due or done:
            state.scheduler = scheduler.state_dict()
            hooks.on_checkpoint(state, {**metrics, "eval_loss": state.eval_loss, **state.eval_metrics})
        if notice is not None and notice.save_now(state) and not done:
            if not ckpt_due:
                state.scheduler = scheduler.state_dict()
                hooks.on_checkpoint(state, {**metrics, "eval_loss": state.eval_loss, **state.eval_metrics})
            notice.saved(state)
    return state
