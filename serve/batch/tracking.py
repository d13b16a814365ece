"""Eval results into MLflow: one run per evaluation, linked to the model version, and `eval.*` version tags.

The run is the evidence: it names the version and the sha256 digest of the bytes evaluated
(`rayline.weights_digest`), and its logged metrics are what the rollout's gate reads (serve/promotion/gate.py
`eval_figures`). The `eval.*` version tags are a copy for people in the MLflow UI; the gate ignores them.
"""

from __future__ import annotations

from core import registry
from core.config import config_hash, flatten
from serve.online.engine import ModelInfo

EVAL_TAG_PREFIX = "eval."
"""Model version tags written by eval mode: `eval.<metric>` (e.g. eval.exact_match, 4 decimals), `eval.run_id`,
`eval.dataset`, `eval.rows`, `eval.errors`."""
TAG_MODEL_NAME = registry.TAG_MODEL_NAME
TAG_MODEL_VERSION = registry.TAG_MODEL_VERSION
TAG_MODEL_REF = "rayline.model_ref"
TAG_COMPARED = "rayline.eval_models"
"""On each eval run of a job with several models (adapters, compare): every model it answered with, on the same rows."""
STAGE = "batch_infer"

# Version tags copied onto the eval run so the run alone tells which data and base model it scored.
LINEAGE_FROM_VERSION = (
    registry.TAG_DATASET_VERSION, registry.TAG_DATASET_MANIFEST, registry.TAG_BASE_MODEL,
    registry.TAG_SOURCE_RUN, registry.TAG_CHECKPOINT_URI,
)


def run_tags(cfg, info: ModelInfo) -> dict[str, str]:
    """Tags of the eval run: stage lineage, config hash, the model version and that version's own lineage."""
    tags = registry.lineage_tags(STAGE, **{registry.TAG_CONFIG_HASH: config_hash(cfg)})
    tags[TAG_MODEL_REF] = info.ref
    if info.name and info.version:
        tags[TAG_MODEL_NAME], tags[TAG_MODEL_VERSION] = info.name, info.version
    if info.digest:  # the bytes these figures are of: the only thing the rollout's gate accepts them for
        tags[registry.TAG_WEIGHTS_DIGEST] = info.digest
    tags.update({k: info.tags[k] for k in LINEAGE_FROM_VERSION if k in info.tags})
    return tags


def record_eval(cfg, info: ModelInfo, scores: dict[str, float], counts: dict[str, float],
                compared: list[str] | None = None) -> str:
    """Log an eval run and tag the model version with its metrics; returns the run id. In a job that answered
    with several models at once (`compared`: their labels), each gets a run of its own, named after it and tagged
    with the others (TAG_COMPARED)."""
    import mlflow  # here, not at the top: an infer-mode driver never needs it (core/registry.py)

    name = cfg.run_name or "eval"
    name = f"{name}-{info.label}" if compared or not cfg.run_name else name
    tags = run_tags(cfg, info)
    if compared:
        tags[TAG_COMPARED] = ", ".join(compared)
    with registry.start_run(cfg.mlflow_experiment, name, tags=tags) as run:
        params = {k: v for k, v in flatten(cfg).items() if v is not None}
        # MLflow params are short strings; long values (engine_kwargs blobs) are cut rather than refused.
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({**scores, **counts})
        run_id = run.info.run_id
    if info.name and info.version:
        tags = {f"{EVAL_TAG_PREFIX}{m}": f"{scores[m]:.4f}" for m in cfg.metrics}
        tags.update({
            f"{EVAL_TAG_PREFIX}run_id": run_id,
            f"{EVAL_TAG_PREFIX}dataset": cfg.dataset_name or cfg.input_uri,
            f"{EVAL_TAG_PREFIX}rows": str(int(scores.get("scored_rows", 0))),
            f"{EVAL_TAG_PREFIX}errors": str(int(counts.get("errors", 0))),
        })
        registry.set_display_tags(info.name, info.version, tags)
    return run_id


def record_figures(name: str, version: str, figures: dict[str, float | str], experiment: str = "rayline-eval",
                   run_name: str | None = None) -> str:
    """An eval run of `name`/`version` over its registered bytes with the given figures (`eval.<metric>` or
    `<metric>` -> value), as the batch stage logs one: for benches and tests that promote a version without running
    an eval job. The caller needs the evaluator's rights on `experiment`, as the batch stage does; returns the run id."""
    import mlflow

    mv = registry.client().get_model_version(name, str(version))
    tags = {**registry.lineage_tags(STAGE), TAG_MODEL_NAME: name, TAG_MODEL_VERSION: str(version),
            TAG_MODEL_REF: f"models:/{name}/{version}", registry.TAG_WEIGHTS_DIGEST: mv.tags[registry.TAG_WEIGHTS_DIGEST]}
    with registry.start_run(experiment, run_name or f"eval-{name}-v{version}", tags=tags) as run:
        mlflow.log_metrics({k.removeprefix(EVAL_TAG_PREFIX): float(v) for k, v in figures.items()})
        return run.info.run_id
