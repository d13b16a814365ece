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

Steps 1-2 are `prepare_scored_version`, which a search over DPO settings (posttrain/dpo_tune.py) runs once, on the
driver, for all of its trials.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from data.preference_prepare import prepare_preferences
from core import registry, storage, usage
from posttrain.dpo_config import DpoConfig
from posttrain.dpo_flywheel import pairs_from_eval_run
from posttrain.dpo_loss import DpoObjective
from posttrain.dpo_reference import score_reference
from train.config import TrainConfig
from train.preflight import RunPlan, plan_run
from train.trainer import (TrainResult, build_trainer, connect_ray, productive_seconds_before, result_from_fit,
                           training_goodput)
from train.tracking import TAG_EXPORT_URI, TAG_LATEST_CHECKPOINT, record_usage, register_export, training_run

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
    eval_preference_accuracy: float | None = None
    """Share of eval pairs the policy prefers the chosen answer of more than the reference does, at the end."""


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


@dataclass
class ScoredVersion:
    """What steps 1-2 leave: the preference version with the reference's log-probs, which every DPO run over the
    same pairs and reference (each trial of a search among them) trains on."""

    preference_version: str
    scored_manifest_uri: str
    reference_model: str
    """How lineage names the reference: `models:/NAME/VERSION` or its path."""
    reference_digest: str
    lineage: dict = field(default_factory=dict)
    """The pairs' own lineage (the flywheel's source model and batch run)."""

    def lineage_tags(self) -> dict[str, str]:
        """The tags every run trained on this version and its model version carry (the reference, the version, the
        pairs' lineage); `dpo_tags` adds the stage and the run's beta."""
        return {TAG_REFERENCE_MODEL: self.reference_model, TAG_REFERENCE_DIGEST: self.reference_digest,
                TAG_PREFERENCE_VERSION: self.preference_version,
                **{TAG_PREFERENCE_PREFIX + k: str(v) for k, v in self.lineage.items()}}


def dpo_tags(beta: float, scored: ScoredVersion) -> dict[str, str]:
    """The lineage tags a DPO run and its model version carry beside the train stage's."""
    return {registry.TAG_STAGE: STAGE, **scored.lineage_tags(), TAG_DPO_BETA: str(beta)}


def prepare_scored_version(cfg: DpoConfig) -> ScoredVersion:
    """Steps 1-2 on the driver: the preference version of `cfg.preferences` (with the flywheel's pairs when
    `dpo.from_eval_run` is set) and the reference's log-probs of it, each skipped when it already exists."""
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
    return ScoredVersion(prepared.version, scored.manifest_uri, ref_name, scored.reference_digest,
                         prepared.manifest.get("lineage") or {})


def plan_dpo_run(tcfg: TrainConfig, cluster: dict[str, float]) -> RunPlan:
    """The train stage's plan of a DPO run (`DpoConfig.train_config`): a row is a pair, so two sequences of seq_len
    go through the model per row (what tokens/s and tokens seen count)."""
    plan = plan_run(tcfg, cluster)
    plan.loop.seq_len *= 2
    return plan


def main(cfg: DpoConfig) -> DpoResult:
    """Run (or resume) the DPO job `cfg.run_name`; raise ConfigError before any worker starts on bad input."""
    import ray

    started = time.monotonic()
    connect_ray(elastic=cfg.scaling.elastic)
    meter = usage.StageUsage.start()  # preparing the pairs and scoring the reference are this job's too
    scored = prepare_scored_version(cfg)
    tcfg = cfg.train_config(scored.scored_manifest_uri)
    plan = plan_dpo_run(tcfg, ray.cluster_resources())
    before_s = productive_seconds_before(plan.run_uri)
    tags = dpo_tags(cfg.dpo.beta, scored)
    with training_run(tcfg, plan, extra_tags=tags) as run_id:
        fit_result = build_trainer(tcfg, plan, run_id, objective=DpoObjective(cfg.dpo.beta)).fit()
        result = DpoResult(**vars(result_from_fit(tcfg, plan, run_id, fit_result)),
                           preference_version=scored.preference_version,
                           scored_manifest_uri=scored.scored_manifest_uri, reference_model=scored.reference_model,
                           lineage=scored.lineage,
                           eval_preference_accuracy=(fit_result.metrics or {}).get("eval_preference_accuracy"))
        training_goodput(result, fit_result, before_s, started, run_id)
        client = registry.client()
        client.set_tag(run_id, TAG_LATEST_CHECKPOINT, result.checkpoint_uri)
        client.set_tag(run_id, TAG_EXPORT_URI, result.export_uri)
        registered = None
        if result.export_uri and result.final_step >= plan.total_steps:
            registered = register_export(tcfg, plan, run_id, result.final_step, extra_tags=tags,
                                         export_uri=result.export_uri)
            if registered:
                result.model_name, result.model_version = registered
        result.usage = record_usage("dpo", meter, run_id, registered, None, parent=cfg.model.path)
    return result
