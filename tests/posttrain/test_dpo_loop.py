"""DPO on the shared training loop in one process (no Ray): the loss starts at log 2, falls, the policy comes to prefer
the chosen answers on average, and a run resumed from a mid-run checkpoint continues exactly as the uninterrupted one."""

from __future__ import annotations

import math

import pytest
import torch

from data.preferences import Preference, tokenize_preference
from posttrain.dpo_loss import DpoObjective, pair_logps
from tests.train.test_loop import Recorder
from train.checkpoint import TrainerState, load_checkpoint
from train.config import LoraConfig, OptimConfig
from train.lora import apply_lora
from train.loop import LoopPlan, train_loop
from train.optimizer import build_optimizer

SEQ = 48
PLAN = LoopPlan(total_steps=8, steps_per_epoch=4, grad_accum_steps=1, eval_every_steps=4, checkpoint_every_steps=4,
                grad_clip=1.0, rows_per_micro_batch=4, seq_len=SEQ)
OPTIM = OptimConfig(lr=2e-3)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stack.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [Preference((("user", f"What is {i} + {i % 3}?"),), str(i + i % 3), str(i + i % 3 + 1)) for i in range(16)]
    rows = [tokenize_preference(tok, p, SEQ, tok.pad_token_id) for p in pairs]
    batch = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        chosen, rejected = pair_logps(reference, batch, CPU, torch.float32)
    batch["ref_chosen_logp"], batch["ref_rejected_logp"] = chosen.double(), rejected.double()
    return path, batch


class PairSource:
    def __init__(self, batch, size: int = 4):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["chosen_length"]))]
        self.size = size

    def _batches(self, rows):
        for i in range(0, len(rows) - self.size + 1, self.size):
            yield {k: torch.stack([r[k] for r in rows[i:i + self.size]]) for k in rows[0]}

    def train_batches(self, epoch: int):
        g = torch.Generator().manual_seed(epoch)
        return self._batches([self.rows[i] for i in torch.randperm(len(self.rows), generator=g).tolist()])

    def eval_batches(self):
        return self._batches(self.rows[:8])


def run(path, batch, hooks_factory, restore=None, lora: LoraConfig | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        model = apply_lora(model, lora, str(path))
    optimizer, scheduler = build_optimizer(model, OPTIM, PLAN.total_steps)
    state = load_checkpoint(restore, model, optimizer, scheduler, rank=0) if restore else TrainerState()
    hooks = hooks_factory(model, optimizer)
    train_loop(model, optimizer, scheduler, PairSource(batch), PLAN, state, hooks, CPU, objective=DpoObjective(0.5))
    return hooks, model


def test_dpo_on_the_shared_loop_starts_at_log_2_and_learns_the_preference(setup):
    path, batch = setup
    hooks, model = run(path, batch, lambda m, o: Recorder())
    assert hooks.evals[0] == pytest.approx(math.log(2), abs=1e-6)
    assert hooks.evals[8] < hooks.evals[0] - 0.05
    with torch.no_grad():
        chosen, rejected = pair_logps(model.eval(), batch, CPU, torch.float32)
    margins = (chosen - batch["ref_chosen_logp"]) - (rejected - batch["ref_rejected_logp"])
    # On average over every pair, the policy now prefers the chosen answer more than the reference does.
    assert float(margins.mean()) > 0


def test_a_resumed_dpo_run_continues_as_the_uninterrupted_one(setup, tmp_path):
    path, batch = setup
    ckpt = tmp_path / "ckpt"
    full, _ = run(path, batch, lambda m, o: Recorder(ckpt, m, o, at_step=4))
    resumed, _ = run(path, batch, lambda m, o: Recorder(), restore=ckpt)
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed.losses[step] == full.losses[step]
    assert resumed.evals[8] == full.evals[8]


def test_dpo_trains_a_lora_adapter_on_the_frozen_base(setup):
    """Under LoRA the reference is the frozen base itself: the adapter starts at zero (loss log 2) and alone learns."""
    path, batch = setup
    hooks, model = run(path, batch, lambda m, o: Recorder(), lora=LoraConfig(enabled=True, rank=4, alpha=8.0))
    assert hooks.evals[0] == pytest.approx(math.log(2), abs=1e-6)
    assert hooks.evals[8] < hooks.evals[0]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
