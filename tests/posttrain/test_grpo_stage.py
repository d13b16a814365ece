"""GRPO on the real parts: vLLM CPU engines in Ray actors, the FSDP2 policy actor, MLflow, the test stack.

One engine-and-policy pair checks the weight sync; one stage run (a fault injected midway) checks that GRPO raises the
verifier's reward and exact match, that the run resumes from its checkpoint with every prompt consumed once and no
update mixing policy steps, and that the result is registered with its lineage."""

from __future__ import annotations

import json

import pytest

from stack.warm_policy import write_prompts
from tests.posttrain.grpo_faults import kill_roles_before
from core import registry
from core.config import load_config
from posttrain.grpo.config import GrpoConfig

pytestmark = pytest.mark.slow
CONFIG = "configs/post_train/grpo_tiny.yaml"


@pytest.fixture(scope="module")
def policy_dir(warm_policy_dir):
    return warm_policy_dir


def test_after_a_sync_the_engine_scores_the_next_token_as_the_trainer_does(ray_session, policy_dir):
    """A full-weight policy, then a LoRA one (policy.lora.enabled: train/lora.py's adapter on the frozen start) on the
    same engine: after each sync the engine computes what the trainer's model does; for LoRA it gets the start's
    weights with the adapter folded in."""
    import ray
    from transformers import AutoTokenizer

    from posttrain.grpo.policy import policy_group
    from posttrain.grpo.rollout_pool import RolloutPool

    cfg = load_config(GrpoConfig, CONFIG, ["prompts.uri=unused", "output_uri=unused", "policy.lora.enabled=true",
                                           "policy.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                           "down_proj]"])
    pool = RolloutPool(str(policy_dir), cfg.engine, 1)
    engine = pool.actors[0]
    tok = AutoTokenizer.from_pretrained(policy_dir)
    ids = list(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])

    def gap(a: dict, b: dict) -> float:
        assert set(a) == set(b), f"top-5 next tokens differ: engine {a}, trainer {b}"
        return max(abs(a[t] - b[t]) for t in a)

    try:
        for step, lora in ((1, None), (2, cfg.policy.lora)):
            (policy,) = policy_group(str(policy_dir), 1, 0.8, 2, 1e-2, 0.0, 0.2, 0.0, 0, lora=lora)

            def both() -> tuple[dict, dict]:
                return (ray.get(engine.next_token_logprobs.remote(ids, 5)),
                        ray.get(policy.next_token_logprobs.remote(ids, 5)))
            try:
                if lora is not None:  # the engine holds the full policy's step: back to the start, its adapter at 0
                    pool.load_weights(policy.full_weights.remote(), step - 1)
                assert gap(*both()) < 1e-3  # same start, same float32 weights
                samples, _ = ray.get(pool.generate([(0, ids)], 8, 6, 1.0, 0))[0]
                rows = [(s.prompt_ids, s.completion_ids) for s in samples]
                ray.get(policy.train_step.remote(rows, [1.0, -1.0] * 4, 8))
                engine_lp, trainer_lp = both()
                moved = {t: engine_lp.get(t) for t in trainer_lp}
                assert any(v is None or abs(v - trainer_lp[t]) > 1e-2 for t, v in moved.items()), "the step changed nothing"
                seconds = pool.load_weights(policy.full_weights.remote(), step)
                assert seconds[0] > 0
                assert gap(*both()) < 1e-3, "lora" if lora else "full"
                assert ray.get(pool.generate([(0, ids)], 2, 2, 1.0, 0))[0][0][0].policy_step == step
            finally:
                ray.kill(policy)
    finally:
        ray.kill(engine)


def test_grpo_raises_reward_and_exact_match_resumes_after_losing_roles_and_registers(local_stack, policy_dir,
                                                                                     tmp_path):
    from stack import mlflow_auth
    from posttrain.grpo import stage

    prompts = write_prompts(tmp_path / "prompts.jsonl", 400, seed=1)
    evals = write_prompts(tmp_path / "eval.jsonl", 100, seed=2)
    name = f"grpo-test-{tmp_path.name[-8:]}{mlflow_auth.CANDIDATES_SUFFIX}"
    cfg = load_config(GrpoConfig, CONFIG, [
        f"model={policy_dir}", f"prompts.uri={prompts}", "prompts.dataset_version=sum-test-v1", f"eval_uri={evals}",
        f"output_uri={tmp_path / 'out'}", "run_name=grpo-test", f"register_as={name}",
        "steps=8", "checkpoint_every=3"])
    result = stage.main(cfg, before_update=kill_roles_before(5))

    # Lost roles at update 5: resumed from the step-3 checkpoint, updates 4-5 redone, each prompt once in the history.
    assert result.restarts == 1
    assert result.ledger == {"updates": 8, "prompts": 8 * cfg.prompts_per_step}
    ledger = [json.loads(line) for line in (tmp_path / "out" / "grpo-test" / "ledger.jsonl").read_text().splitlines()]
    assert [e["policy_steps"] for e in ledger] == [[s] for s in range(8)]

    client = registry.client()
    mv = client.get_model_version(name, result.model_version)
    assert mv.tags[registry.TAG_STAGE] == "grpo"
    assert mv.tags["rayline.parent_version"] == str(policy_dir)
    assert mv.tags[registry.TAG_DATASET_VERSION] == "sum-test-v1"
    assert mv.tags[registry.TAG_WEIGHTS_DIGEST]
    # What the job used (core/usage.py): the policy ranks, the rollout engines and the reference, beside the driver.
    used = result.usage
    assert used.cpu_s - used.driver_cpu_s > 10.0 and used.processes >= 4, used
    assert mv.tags["rayline.usage.grpo_cpu_s"] == f"{used.cpu_s:.1f}"
    assert mv.tags["rayline.usage.total_cpu_s"] == mv.tags["rayline.usage.grpo_cpu_s"]

    history = [m.value for m in client.get_metric_history(result.mlflow_run_id, "grpo/reward_mean")]
    first, last = sum(history[:2]) / 2, sum(history[-2:]) / 2
    assert last > first, f"reward did not rise: {history}"
    assert result.exact_match_after > result.exact_match_before, result
