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


def _independent_logps(model, batch) -> list[dict[str, float]]:
    """Each answer on its own, unpadded, with the model's default causal mask: log-softmax, pick the next token where
    the label is set, sum, in float64; per pair {chosen, rejected}."""
    out = []
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
        out.append(logp)
    return out


def _independent_loss(model, tok, batch, beta) -> float:
    """-log(sigmoid(beta * margin)) of the independent log-probs, averaged over pairs."""
    losses = []
    for i, logp in enumerate(_independent_logps(model, batch)):
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


def test_an_evaluation_reports_the_beta_free_preference_accuracy_and_margin(tiny):
    """The reference log-probs are set so the log-ratio margins are exactly -0.5, 0.25 and -1.0 (against independently
    computed policy log-probs): one pair of three preferred, mean margin -1.25 / 3, whatever beta; the loss is the
    beta's own."""
    from train.loop import evaluate

    model, tok = tiny
    batch = _batch(tok)
    logps = _independent_logps(model, batch)
    shifts = [0.5, -0.25, 1.0]  # ref_chosen above the policy's by this much: margin = -shift
    batch["ref_chosen_logp"] = torch.tensor([p["chosen"] + d for p, d in zip(logps, shifts)], dtype=torch.float64)
    batch["ref_rejected_logp"] = torch.tensor([p["rejected"] for p in logps], dtype=torch.float64)
    results = {beta: evaluate(model, [batch], torch.device("cpu"), torch.float32, DpoObjective(beta))
               for beta in (0.1, 2.0)}
    for beta, metrics in results.items():
        assert set(metrics) == {"eval_loss", "eval_preference_accuracy", "eval_logratio_margin"}
        assert metrics["eval_preference_accuracy"] == pytest.approx(1 / 3)
        assert metrics["eval_logratio_margin"] == pytest.approx(-1.25 / 3, abs=1e-4)
        expected = sum(-math.log(1.0 / (1.0 + math.exp(beta * d))) for d in shifts) / 3
        assert metrics["eval_loss"] == pytest.approx(expected, abs=1e-4)
    assert results[0.1]["eval_loss"] != pytest.approx(results[2.0]["eval_loss"], abs=1e-2)
