"""The DPO stage on the driver: preference version -> reference log-probs -> DPO on the shared FSDP2 loop -> registered.

    from posttrain.dpo_stage import main
    result = main(cfg)      # or: python -m pipelines.dpo --config configs/post_train/dpo_tiny.yaml

1. `data.preference_prepare`: the pairs as a content-addressed preference version (skipped when it exists).
2. `posttrain.dpo_reference`: the frozen reference's log-probs of every pair, one Ray Data pass per (version,
   reference bytes), stored in the version (skipped when they exist).
3. The train stage's TorchTrainer (train/trainer.py `build_trainer`) with the DPO objective: the same workers, FSDP2,
   checkpoints, resume, export (full weights or a LoRA adapter) and MLflow curves as a fine-tune.
4. The export registers like a fine-tune (weights manifest, digest; the trainer role, into `mlflow.register_as`),
   tagged `rayline.stage: dpo` with the reference version and the preference version, so the batch eval, gate,
   rollout and canary take it as they take any candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from data.preference_prepare import prepare_preferences
from core import registry, storage
from posttrain.dpo_config import DpoConfig
from posttrain.dpo_flywheel import pairs_from_eval_run
from posttrain.dpo_loss import DpoObjective
from posttrain.dpo_reference import score_reference
from train.trainer import TrainResult, build_trainer, connect_ray, result_from_fit
from train.tracking import TAG_EXPORT_URI, TAG_LATEST_CHECKPOINT, register_export, training_run

STAGE = "dpo"
TAG_REFERENCE_MODEL = "rayline.reference_model"
TAG_REFERENCE_DIGEST = "rayline.reference_digest"
TAG_PREFERENCE_VERSION = "rayline.preference_version"
TAG_DPO_BETA = "rayline.dpo_beta"
TAG_PREFERENCE_PREFIX = "rayline.preference_"
"""Lineage of the pairs themselves (the flywheel's: source model version, batch run), as `rayline.preference_<key>`."""


@dataclass
class DpoResult(TrainResult):
    preference_version: str = ""
    scored_manifest_uri: str = ""
    reference_model: str = ""
    lineage: dict = field(default_factory=dict)


def resolve_reference(ref: str) -> tuple[str, str, str]:
    """(the reference's files: a local absolute path or s3:// URI, its exact name: `models:/NAME/VERSION` for a
    registered model, an alias resolved, and its registered weights digest: "" for a path)."""
    uri = registry.resolve_model_uri(ref)  # its bytes are checked against `digest` before they are scored
    uri = uri if storage.is_remote(uri) else storage.resolve(uri)[1]
    digest = ""
    if ref.startswith("models:/"):
        mv = registry.get_version(ref)
        ref, digest = f"models:/{mv.name}/{mv.version}", (mv.tags or {}).get(registry.TAG_WEIGHTS_DIGEST, "")
    return uri, ref, digest


def dpo_tags(cfg: DpoConfig, version: str, reference: str, digest: str, lineage: dict) -> dict[str, str]:
    """The lineage tags the DPO run and its model version carry beside the train stage's."""
    return {registry.TAG_STAGE: STAGE, TAG_REFERENCE_MODEL: reference, TAG_REFERENCE_DIGEST: digest,
            TAG_PREFERENCE_VERSION: version, TAG_DPO_BETA: str(cfg.dpo.beta),
            **{TAG_PREFERENCE_PREFIX + k: str(v) for k, v in lineage.items()}}


def main(cfg: DpoConfig) -> DpoResult:
    """Run (or resume) the DPO job `cfg.run_name`; raise ConfigError before any worker starts on bad input."""
    import ray

    from train.preflight import plan_run

    connect_ray()
    ref_uri, ref_name, ref_digest = resolve_reference(cfg.reference)
    prefs = replace(cfg.preferences, tokenizer=cfg.preferences.tokenizer or ref_uri)
    if cfg.dpo.from_eval_run:
        pairs_uri, lineage, n = pairs_from_eval_run(cfg.dpo.from_eval_run, prefs.output_uri)
        print(f"flywheel    {n} wrong answers of {lineage['source_model']} (eval run {cfg.dpo.from_eval_run}) "
              f"-> {pairs_uri}", flush=True)
        prefs = replace(prefs, inputs=[*prefs.inputs, pairs_uri], lineage={**lineage, **prefs.lineage})
    prepared = prepare_preferences(prefs)
    print(f"preferences {prepared.version}: {prepared.counts['written_examples']} pairs "
          f"({prepared.counts['rejected']} rejected, {prepared.counts['deduplicated']} duplicates)"
          + ("  (already prepared)" if prepared.skipped else ""), flush=True)
    scored = score_reference(prepared.manifest_uri, ref_uri, ref_name, cfg.dpo.reference_batch_size,
                             cfg.dpo.reference_gpus, ref_digest)
    print(f"reference   {ref_name}: log-probs in {scored.manifest_uri}"
          + ("  (already computed)" if scored.skipped else ""), flush=True)

    tcfg = cfg.train_config(scored.manifest_uri)
    plan = plan_run(tcfg, ray.cluster_resources())
    plan.loop.seq_len *= 2  # a row is a pair: two sequences of seq_len go through the model (tokens/s, tokens seen)
    lineage = prepared.manifest.get("lineage") or {}
    tags = dpo_tags(cfg, prepared.version, ref_name, scored.reference_digest, lineage)
    with training_run(tcfg, plan, extra_tags=tags) as run_id:
        fit_result = build_trainer(tcfg, plan, run_id, objective=DpoObjective(cfg.dpo.beta)).fit()
        result = DpoResult(**vars(result_from_fit(tcfg, plan, run_id, fit_result)),
                           preference_version=prepared.version, scored_manifest_uri=scored.manifest_uri,
                           reference_model=ref_name, lineage=lineage)
        client = registry.client()
        client.set_tag(run_id, TAG_LATEST_CHECKPOINT, result.checkpoint_uri)
        client.set_tag(run_id, TAG_EXPORT_URI, result.export_uri)
        if result.export_uri and result.final_step >= plan.total_steps:
            registered = register_export(tcfg, plan, run_id, result.final_step, extra_tags=tags,
                                         export_uri=result.export_uri)
            if registered:
                result.model_name, result.model_version = registered
    return result
