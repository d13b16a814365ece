"""GRPO scored by a reward model served by an engine pool (`reward.name: model`, posttrain/grpo/reward_pool.py), on
the real parts: vLLM's pooling runner on CPU in a Ray actor, the test stack, MLflow.

The pool's scores are the reward model's as transformers computes them; a stage run with it trains on those scores
(rewards in the model's range, not the verifier's) and names the reward model in its run's and version's lineage."""

from __future__ import annotations

import pytest

from core import registry
from core.config import load_config
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.reward_pool import check_reward_model
from posttrain.grpo.tracking import TAG_REWARD_MODEL
from stack.tiny_model import build_reward_model
from stack.warm_policy import write_prompts

pytestmark = pytest.mark.slow
CONFIG = "configs/post_train/grpo_tiny.yaml"
REWARD_ENGINE = ["reward.name=model"]  # the shipped config's reward engine: 0.3 CPU, float32, 64 MiB of KV cache


@pytest.fixture(scope="module")
def models(warm_policy_dir, tmp_path_factory):
    reward = build_reward_model(warm_policy_dir.parent / "base", tmp_path_factory.mktemp("grpo-rm") / "reward", seed=3)
    return warm_policy_dir, reward


def test_a_causal_lm_is_refused_as_a_reward_model_naming_what_it_is(models):
    policy, _ = models
    with pytest.raises(ValueError, match=r"reward\.model: .* is \['LlamaForCausalLM'\] with 2 label\(s\); a reward "
                                         r"model is a \*ForSequenceClassification checkpoint with one label"):
        check_reward_model(str(policy))


def test_the_pool_scores_what_transformers_computes(ray_session, models):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.grpo.reward_pool import RewardPool

    _, reward = models
    cfg = load_config(GrpoConfig, CONFIG, ["prompts.uri=unused", "output_uri=unused", f"reward.model={reward}",
                                           *REWARD_ENGINE])
    tok = AutoTokenizer.from_pretrained(reward)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + 4?"}], add_generation_prompt=True,
                                     tokenize=False) + answer for a, answer in ((3, "7"), (3, "8"), (12, "16"))]
    hf = AutoModelForSequenceClassification.from_pretrained(reward)
    with torch.no_grad():
        expected = [hf(torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits[0, 0].item() for t in texts]
    pool = RewardPool(str(reward), cfg.reward.engine, 1)
    try:
        import ray

        got = ray.get(pool.score(texts))
    finally:
        pool.shutdown()
    assert got == pytest.approx(expected, abs=1e-4)
    assert len({round(x, 4) for x in got}) == 3  # the answers score differently: the completion is read


def test_grpo_trains_on_the_reward_models_scores_and_names_it_in_the_lineage(local_stack, models, tmp_path):
    from posttrain.grpo import stage
    from stack import mlflow_auth

    policy, reward = models
    prompts = write_prompts(tmp_path / "prompts.jsonl", 64, seed=1)
    name = f"grpo-rm-test-{tmp_path.name[-8:]}{mlflow_auth.CANDIDATES_SUFFIX}"
    cfg = load_config(GrpoConfig, CONFIG, [
        f"model={policy}", f"prompts.uri={prompts}", "eval_uri=", f"output_uri={tmp_path / 'out'}",
        "run_name=grpo-rm-test", f"register_as={name}", "steps=2", "prompts_per_step=8", "group_size=4",
        "checkpoint_every=0", f"reward.model={reward}", *REWARD_ENGINE])
    result = stage.main(cfg)
    client = registry.client()
    history = [m.value for m in client.get_metric_history(result.mlflow_run_id, "grpo/reward_mean")]
    assert len(history) == 2
    # The verifier's rewards lie in [0, 1.1]; this untrained head scores the tiny model's texts around -3 to -5.
    assert all(v < -1.0 for v in history), history
    tags = client.get_model_version(name, result.model_version).tags
    assert tags[TAG_REWARD_MODEL] == str(reward) and tags[registry.TAG_STAGE] == "grpo"
    assert client.get_run(result.mlflow_run_id).data.tags[TAG_REWARD_MODEL] == str(reward)
