"""The GRPO stage: resolve the policy's start, read the prompts, run the loop (loop.py) inside an MLflow run, export
the trained policy as a Hugging Face checkpoint and register it into `<model>-candidates` as the trainer does a
fine-tune (its digest, `rayline.stage: grpo`, the parent version, the prompt dataset version)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.usage import Usage
from posttrain.grpo.config import MODEL_REWARD, GrpoConfig


@dataclass
class GrpoResult:
    run_name: str
    steps: int
    prompts_consumed: int
    restarts: int
    reward_first: float
    reward_last: float
    exact_match_before: float | None
    exact_match_after: float | None
    export_dir: str
    mlflow_run_id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    ledger: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    usage: Usage | None = None
    """CPU- and GPU-seconds of the job's processes: policy ranks, rollout engines, reference (core/usage.py)."""


def export(weights: dict, base_dir: str, out: Path, info: dict) -> Path:
    """The trained weights as a loadable HF checkpoint (config and tokenizer from the start model)."""
    import torch

    from train.export import write_hf_checkpoint

    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    return write_hf_checkpoint(state, base_dir, out, torch.float32, info)


def main(cfg: GrpoConfig, before_update=None, after_update=None, parent_run_id: str | None = None,
         extra_tags: dict[str, str] | None = None) -> GrpoResult:
    """Run the stage. `after_update(StepMetrics)` is called after each update beside the stage's own logging;
    `parent_run_id` and `extra_tags` make the run a child run (a search's trial, posttrain/grpo_tune.py), whose
    usage its search records for the whole job (so the trial's run carries none)."""
    from transformers import AutoTokenizer

    from core import registry, usage
    from train.tracking import record_usage
    from core.ray_cluster import init_ray
    from posttrain.grpo import loop, tracking
    from posttrain.grpo.prompts import file_digest, load_prompts
    from serve.online.engine import resolve_model

    started = time.time()
    model_dir, info = resolve_model(cfg.model)
    # How lineage names the start: `models:/NAME/VERSION` (an alias resolved), as train and DPO name theirs, so the
    # batch eval compares the version with it when one job scores both; else its path.
    parent = f"models:/{info.label}" if info.name and info.version else info.label
    reward_dir = reward_model = ""
    if cfg.reward.name == MODEL_REWARD:  # the reward model is resolved (and its bytes checked) as the policy's start is
        reward_dir, reward_info = resolve_model(cfg.reward.model)
        reward_model = (f"models:/{reward_info.label}" if reward_info.name and reward_info.version
                        else reward_info.label)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(cfg.prompts.uri, tokenizer, cfg.prompts.tasks, cfg.prompts.limit)
    eval_prompts = load_prompts(cfg.eval_uri, tokenizer, limit=cfg.eval_limit) if cfg.eval_uri else None
    dataset_version = cfg.prompts.dataset_version or file_digest(cfg.prompts.uri)
    run_name = cfg.run_name or f"grpo-{int(started)}"
    output = Path(cfg.output_uri).resolve() / run_name
    init_ray()
    meter = None if parent_run_id else usage.StageUsage.start()
    tags = {**tracking.run_tags(cfg, parent, dataset_version, reward_model), **(extra_tags or {})}
    run_ctx = (registry.start_run(cfg.mlflow_experiment, run_name, tags=tags, resume=True, parent_run_id=parent_run_id)
               if cfg.mlflow_experiment else contextlib.nullcontext())
    with run_ctx as run:
        run_id = run.info.run_id if run else None
        # Prometheus labels stay bounded: the registered model's name, never a path.
        log = tracking.step_logger(run_id, info.name or "local") if run_id else None

        def on_step(m: loop.StepMetrics) -> None:
            print(f"grpo step {m.step}/{cfg.steps}: reward {m.reward_mean:.3f} (std {m.reward_std:.3f}), "
                  f"kl {m.kl:.4f}, rollout {m.rollout_tokens_per_s:.0f} tok/s, sync {m.weight_sync_s:.2f}s, "
                  f"lag {m.policy_lag}, prompts {m.prompts_consumed}, {m.step_s:.1f}s", flush=True)
            if log:
                log(m)
            if after_update:
                after_update(m)
        if run_id:
            tracking.log_params(run_id, cfg)
        res = loop.run(cfg, model_dir, prompts, output, on_step, eval_prompts, before_update, reward_dir)
        export_dir = export(res.final_weights, model_dir, output / "export",
                            {"stage": "grpo", "parent": parent, "steps": res.steps, "dataset_version": dataset_version})
        result = GrpoResult(run_name, res.steps, res.prompts_consumed, res.restarts,
                            res.history[0].reward_mean if res.history else float("nan"),
                            res.history[-1].reward_mean if res.history else float("nan"),
                            res.exact_match_before, res.exact_match_after, str(export_dir), run_id, ledger=res.ledger)
        if run_id:
            client = registry.client()
            for key in ("exact_match_before", "exact_match_after"):
                if getattr(res, key) is not None:
                    client.log_metric(run_id, f"grpo/{key}", getattr(res, key), step=res.steps)
            client.log_dict(run_id, {"ledger": res.ledger}, "grpo_ledger_check.json")
            if cfg.register_as:
                result.model_name = cfg.register_as
                result.model_version = tracking.register(cfg.register_as, str(export_dir), run_id, tags, res.steps)
        registered = (result.model_name, result.model_version) if result.model_version else None
        if meter:
            result.usage = record_usage("grpo", meter, run_id, registered, None, parent=parent)
    result.seconds = round(time.time() - started, 1)
    (output / "result.json").write_text(json.dumps(asdict(result), indent=2))
    return result
