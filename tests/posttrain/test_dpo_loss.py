"""The DPO loss on a fixed batch against an independent plain-torch implementation of the paper's formula."""

from __future__ import annotations

import math

import pytest
import torch

from data.preferences import Preference, tokenize_preference
from posttrain.dpo_loss import DpoObjective

PAIRS = [
    Preference((("user", "What is 3 + 4?"),), "7", "8"),
    Preference((("system", "Answer with the answer only."), ("user", "Repeat exactly: amber")), "amber", "ambre amber"),
    Preference((("user", "Which is larger, 97 or 8?"),), "97", "8"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stack.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


def _batch(tok, seq_len=48):
    rows = [tokenize_preference(tok, p, seq_len, tok.pad_token_id) for p in PAIRS]
    batch = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
    batch["ref_chosen_logp"] = torch.tensor([-9.5, -14.25, -7.0], dtype=torch.float64)
    batch["ref_rejected_logp"] = torch.tensor([-10.0, -13.0, -8.5], dtype=torch.float64)
    return batch


def _independent_loss(model, tok, batch, beta) -> float:
    """Each answer on its own, unpadded, with the model's default causal mask: log-softmax, pick the next token where
    the label is set, sum; then -log(sigmoid(beta * margin)) averaged over pairs, in float64."""
    losses = []
    for i in range(len(PAIRS)):
        logp = {}
        for side in ("chosen", "rejected"):
            n = int(batch[f"{side}_length"][i])
            ids = batch[f"{side}_input_ids"][i, :n].unsqueeze(0)
            labels = batch[f"{side}_labels"][i, :n]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].double()
            log_probs = torch.log_softmax(logits, dim=-1)
            total = 0.0
            for t in range(1, n):
                if labels[t] != -100:
                    total += float(log_probs[t - 1, labels[t]])
            logp[side] = total
        margin = (logp["chosen"] - float(batch["ref_chosen_logp"][i])) - (
            logp["rejected"] - float(batch["ref_rejected_logp"][i]))
        losses.append(-math.log(1.0 / (1.0 + math.exp(-beta * margin))))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_loss_on_a_fixed_batch_equals_an_independent_implementation(tiny, beta):
    model, tok = tiny
    batch = _batch(tok)
    objective = DpoObjective(beta=beta)
    with torch.no_grad():
        ours = float(objective.loss_sum(model, batch, torch.device("cpu"), torch.float32)) / objective.count(batch)
    assert objective.count(batch) == 3
    assert ours == pytest.approx(_independent_loss(model, tok, batch, beta), abs=1e-5)


def test_a_policy_equal_to_its_reference_has_loss_log_2(tiny):
    model, tok = tiny
    batch = _batch(tok)
    objective = DpoObjective(beta=0.1)
    from posttrain.dpo_loss import pair_logps

    with torch.no_grad():
        chosen, rejected = pair_logps(model, batch, torch.device("cpu"), torch.float32)
    batch["ref_chosen_logp"], batch["ref_rejected_logp"] = chosen.double(), rejected.double()
    with torch.no_grad():
        loss = float(objective.loss_sum(model, batch, torch.device("cpu"), torch.float32)) / 3
    assert loss == pytest.approx(math.log(2), abs=1e-6)
