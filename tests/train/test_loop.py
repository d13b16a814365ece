"""The shared training loop in one process (no Ray, no process group): resume reproduces an uninterrupted run."""

from __future__ import annotations

import random
import time

import pytest
import torch

from train.checkpoint import TrainerState, load_checkpoint, read_trainer_state, save_checkpoint
from train.config import OptimConfig
from train.loop import LoopPlan, train_loop
from train.optimizer import adam_state_summary, build_optimizer

SEQ = 32


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def packed_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows of two documents each: the second half of each document carries loss."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randint(4, SEQ - 8)
        ids = [rng.randrange(3, 64) for _ in range(SEQ)]
        pos = list(range(a)) + list(range(SEQ - a))
        seg = [1] * a + [2] * (SEQ - a)
        labels = [t if (p >= 2) else -100 for t, p in zip(ids, pos)]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg})
    return rows


class ListSource:
    """BatchSource over fixed rows; each epoch reshuffles with its own seed, like the Ray shard source."""

    def __init__(self, rows, batch: int):
        self.rows, self.batch = rows, batch

    def _batches(self, rows):
        for i in range(0, len(rows) - self.batch + 1, self.batch):
            chunk = rows[i : i + self.batch]
            yield {k: torch.tensor([r[k] for r in chunk]) for k in chunk[0]}

    def train_batches(self, epoch: int):
        rows = list(self.rows)
        random.Random(100 + epoch).shuffle(rows)
        return self._batches(rows)

    def eval_batches(self):
        return self._batches(self.rows[:4])


class Recorder:
    def __init__(self, directory=None, model=None, optimizer=None, at_step=None):
        self.losses, self.evals, self.checkpoints = {}, {}, []
        self.directory, self.model, self.optimizer, self.at_step = directory, model, optimizer, at_step

    def on_step(self, state, metrics):
        self.losses[state.step] = (metrics["loss"], metrics["lr"])

    def on_eval(self, state, metrics):
        self.evals[state.step] = metrics["eval_loss"]

    def on_checkpoint(self, state, metrics):
        self.checkpoints.append(state.step)
        if self.directory is not None and state.step == self.at_step:
            save_checkpoint(self.directory, self.model, self.optimizer, state, rank=0)


PLAN = LoopPlan(total_steps=10, steps_per_epoch=3, grad_accum_steps=2, eval_every_steps=4, checkpoint_every_steps=2,
                grad_clip=1.0, rows_per_micro_batch=2, seq_len=SEQ)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.01)


def run(source, hooks_factory, state=None, restore=None):
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer, scheduler = build_optimizer(model, OPTIM, PLAN.total_steps)
    if restore is not None:
        state = load_checkpoint(restore, model, optimizer, scheduler, rank=0)
    hooks = hooks_factory(model, optimizer)
    final = train_loop(model, optimizer, scheduler, source, PLAN, state or TrainerState(), hooks, torch.device("cpu"))
    return hooks, final, optimizer


def test_loss_falls_and_schedule_is_followed():
    source = ListSource(packed_rows(12, seed=1), batch=2)
    hooks, final, _ = run(source, lambda m, o: Recorder())
    assert final.step == 10 and sorted(hooks.losses) == list(range(1, 11))
    # 12 rows / (2 rows x 2 micro-batches) = 3 steps per epoch: 10 steps end one step into epoch 3.
    assert (final.epoch, final.micro_batches_into_epoch) == (3, 2)
    assert hooks.evals[10] < hooks.evals[0]
    assert sorted(hooks.evals) == [0, 4, 8, 10]
    assert hooks.checkpoints == [2, 4, 6, 8, 10]
    lrs = [hooks.losses[s][1] for s in range(1, 11)]
    assert lrs[0] == pytest.approx(1.5e-3) and lrs[1] == pytest.approx(3e-3) and lrs[-1] < lrs[2]


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path):
    """Checkpoint at step 4 (one step into epoch 1), restore into fresh objects: same losses, lr and Adam state."""
    source = ListSource(packed_rows(12, seed=2), batch=2)
    ckpt = tmp_path / "ckpt"
    full, full_final, full_opt = run(source, lambda m, o: Recorder(ckpt, m, o, at_step=4))

    saved = read_trainer_state(ckpt)
    assert (saved.step, saved.epoch, saved.micro_batches_into_epoch) == (4, 1, 2)

    resumed, final, opt = run(source, lambda m, o: Recorder(), restore=ckpt)
    assert sorted(resumed.losses) == list(range(5, 11))
    for step in range(5, 11):
        assert resumed.losses[step] == full.losses[step]  # bit-for-bit: same data position, optimizer, lr, RNG
    assert final.step == 10 and final.tokens_seen == full_final.tokens_seen
    assert adam_state_summary(opt) == adam_state_summary(full_opt)


def test_restored_optimizer_is_not_fresh(tmp_path):
    source = ListSource(packed_rows(12, seed=3), batch=2)
    ckpt = tmp_path / "ckpt"
    run(source, lambda m, o: Recorder(ckpt, m, o, at_step=6))
    model = tiny_llama()
    optimizer, scheduler = build_optimizer(model, OPTIM, PLAN.total_steps)
    state = load_checkpoint(ckpt, model, optimizer, scheduler, rank=0)
    summary = adam_state_summary(optimizer)
    assert state.step == 6 and summary["adam_step"] == 6.0 and summary["adam_m_sumsq"] > 0
    assert scheduler.last_epoch == 6


class SlowHooks(Recorder):
    """Hooks that take time between steps, as MLflow logging and checkpoints do."""

    def on_step(self, state, metrics):
        super().on_step(state, metrics)
        time.sleep(0.05)

    def on_checkpoint(self, state, metrics):
        super().on_checkpoint(state, metrics)
        self.walls = {**getattr(self, "walls", {}), state.step: state.wall_time_s}
        time.sleep(0.1)


def test_wall_time_holds_what_runs_between_steps_and_step_time_does_not():
    # bench_train times the run by wall_time_s: the hooks' time is the run's time too.
    source = ListSource(packed_rows(12, seed=3), batch=2)
    hooks, final, _ = run(source, lambda m, o: SlowHooks())
    # 10 steps; between step 1 and step 10: 9 on_step sleeps and the checkpoints at 2, 4, 6, 8 (0.1 s each).
    between = 9 * 0.05 + 4 * 0.1
    assert final.wall_time_s >= final.train_time_s + between
    assert final.wall_time_s - final.train_time_s < between + 2.0  # nothing else of size: eval at 4 and 8 only
    # The clock at a checkpoint runs to that step's end: the window 2 -> 10 holds the hooks of steps 2 to 9.
    assert hooks.walls[10] - hooks.walls[2] >= 8 * 0.05 + 4 * 0.1
