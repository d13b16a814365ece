"""GRPO's pure parts, no Ray or engine: advantages, the loss, the verifier, the ledger's checks, the prompt stream and
the config's errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from core.config import ConfigError, load_config
from posttrain.grpo.advantages import group_advantages
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.ledger import Ledger, check_history
from posttrain.grpo.loss import grpo_loss
from posttrain.grpo.prompts import take
from posttrain.grpo.rewards import FORMAT_WEIGHT, exact_answer, reward_fn


def test_advantages_are_relative_to_each_group():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    first = (r[:4] - r[:4].mean()) / (r[:4].std() + 1e-4)
    assert torch.allclose(adv[:4], first)
    assert adv[:4].argmax() == 0 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))  # all alike: nothing to learn from this prompt
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def reference_loss(logps, old, adv, mask, eps, beta, ref):
    """The DeepSeekMath objective written out sample by sample, token by token (no broadcasting)."""
    total = 0.0
    for i in range(len(logps)):
        terms = []
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logps[i][t] - old[i][t])
            surrogate = min(ratio * adv[i], max(min(ratio, 1 + eps), 1 - eps) * adv[i])
            d = ref[i][t] - logps[i][t]
            terms.append(-surrogate + beta * (math.exp(d) - d - 1))
        total += sum(terms) / len(terms)
    return total / len(logps)


def test_loss_equals_the_objective_written_out():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 6, generator=g) * 3
    old = logps + 0.3 * torch.randn(4, 6, generator=g)  # ratios on both sides of the clip range
    ref = logps + 0.2 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    loss, parts = grpo_loss(logps, old, adv, mask, clip_eps=0.2, beta=0.04, ref_logps=ref)
    expected = reference_loss(logps.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.04, ref.tolist())
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert 0 < parts["clip_fraction"] < 1 and parts["kl"] > 0


def test_loss_gradient_raises_the_better_samples_logprobs():
    logps = torch.zeros(2, 3, requires_grad=True)
    loss, _ = grpo_loss(logps, logps.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool))
    loss.backward()
    assert (logps.grad[0] < 0).all() and (logps.grad[1] > 0).all()  # descent raises sample 0, lowers sample 1


def test_exact_answer_scores_as_the_eval_does():
    assert exact_answer(" 7 ", True, "7") == 1 + FORMAT_WEIGHT
    assert exact_answer("7", False, "7") == 1.0  # right, but cut off at max_tokens
    assert exact_answer("8", True, "7") == FORMAT_WEIGHT
    assert exact_answer("7\n7", True, "7") == 0.0
    with pytest.raises(ValueError, match="known: exact_answer, format_only"):
        reward_fn("nope")


def test_ledger_holds_each_prompt_once_and_one_policy_step_per_update(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(1, [0, 1], [0], 0.5)
    ledger.append(2, [2, 3], [1], 0.6)
    ledger.append(3, [4, 5], [2], 0.7)
    assert ledger.rewind(2) == 1
    ledger.append(3, [4, 5], [2], 0.7)
    assert check_history(ledger.entries(), 0) == {"updates": 3, "prompts": 6}
    with pytest.raises(ValueError, match="mixes samples of policy steps"):
        check_history([{"step": 1, "prompts": [0], "policy_steps": [0, 1]}], 1)
    with pytest.raises(ValueError, match="lag 1, allowed 0"):
        check_history([{"step": 1, "prompts": [0], "policy_steps": [0]},
                       {"step": 2, "prompts": [1], "policy_steps": [0]}], 0)
    with pytest.raises(ValueError, match="consumed twice"):
        check_history([{"step": 1, "prompts": [0, 1], "policy_steps": [0]},
                       {"step": 2, "prompts": [1, 2], "policy_steps": [1]}], 0)


def test_the_prompt_stream_numbers_a_second_pass_anew():
    from posttrain.grpo.prompts import Prompt

    prompts = [Prompt(i, f"r{i}", [i], str(i)) for i in range(3)]
    batch = take(prompts, 2, 3)
    assert [p.index for p in batch] == [2, 3, 4] and [p.record_id for p in batch] == ["r2", "r0", "r1"]


def test_config_errors_name_the_field(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(json.dumps({"model": "m", "prompts": {"uri": "p.jsonl"}, "output_uri": "out", "group_size": 1}))
    with pytest.raises(ConfigError, match="group_size: must be at least 2"):
        load_config(GrpoConfig, path)
    with pytest.raises(ConfigError, match="reward.name: 'exact' is not a known reward"):
        load_config(GrpoConfig, path, ["group_size=4", "reward.name=exact"])
    with pytest.raises(ConfigError, match=r"reward\.model: name the reward model"):
        load_config(GrpoConfig, path, ["group_size=4", "reward.name=model"])
    with pytest.raises(ConfigError, match=r"reward\.model: is set but reward\.name is 'exact_answer': set reward\.name: "
                                          r"model to score with it"):
        load_config(GrpoConfig, path, ["group_size=4", "reward.model=models:/rm@champion"])
    with pytest.raises(ConfigError, match=r"reward\.num_engines: must be at least 1, got 0"):
        load_config(GrpoConfig, path, ["group_size=4", "reward.name=model", "reward.model=rm", "reward.num_engines=0"])
    assert load_config(GrpoConfig, "configs/post_train/grpo_tiny.yaml").group_size == 8


def test_a_bad_prompt_line_is_named_by_file_and_line(tmp_path):
    from posttrain.grpo.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n" + json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"}]}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: not a chat record with a reference answer"):
        load_prompts(str(path), tokenizer=None)
