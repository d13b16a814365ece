"""The data-prep run in MLflow: lineage tags, the flattened config, counts as metrics, the version as a dataset input.

MLflow is optional for this stage: without MLFLOW_TRACKING_URI set, the run is skipped with a note
(a laptop run still writes its manifest). When it is set, a tracking server that fails is an error.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from data.config import Config
from core import registry
from core.config import flatten


def tracking_configured() -> bool:
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


@contextmanager
def data_run(cfg: Config, version: str, manifest_uri: str) -> Iterator[str | None]:
    """An MLflow run around the stage's work (FAILED if the stage raises); yields its id, or None."""
    if not tracking_configured():
        print("MLFLOW_TRACKING_URI is not set: no MLflow run is logged (the manifest is still written)")
        yield None
        return
    import mlflow

    tags = registry.lineage_tags("data", **{registry.TAG_DATASET_VERSION: version,
                                            registry.TAG_DATASET_MANIFEST: manifest_uri})
    with registry.start_run(cfg.mlflow_experiment, f"data-{version}", tags=tags) as run:
        params = {k: ("" if v is None else str(v))[:6000] for k, v in flatten(cfg).items()}
        mlflow.log_params(params)
        yield run.info.run_id


def metrics_of(manifest: dict, wall_s: float) -> dict[str, float]:
    c, s = manifest["counts"], manifest["splits"]
    metrics = {f"counts.{k}": float(v) for k, v in c.items() if k != "rejected_by_reason"}
    metrics.update({f"rejected.{reason.replace(':', '.')}": float(n) for reason, n in c["rejected_by_reason"].items()})
    for split in ("train", "eval"):
        metrics.update({f"{split}.{k}": float(v) for k, v in s[split].items() if k != "path"})
    tokens = s["train"]["tokens"] + s["eval"]["tokens"]
    metrics.update({"tokens": float(tokens), "packing_efficiency": float(manifest["packing_efficiency"]),
                    "wall_s": wall_s, "tokens_per_s": tokens / max(wall_s, 1e-9)})
    return metrics


def dataset_source(uri: str):
    """The MLflow dataset source of a prepared version's URI (local path or s3://), from mlflow.data.sources."""
    from mlflow.data.sources import LocalArtifactDatasetSource, S3ArtifactDatasetSource

    return S3ArtifactDatasetSource(uri) if uri.startswith("s3://") else LocalArtifactDatasetSource(uri)


def log_outcome(manifest: dict, manifest_uri: str, wall_s: float) -> None:
    """Metrics for the counts, and the prepared version as an MLflow dataset input (source = output URI)."""
    import mlflow
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    mlflow.log_metrics(metrics_of(manifest, wall_s))
    version_uri = manifest_uri.rsplit("/", 1)[0]
    schema = Schema([ColSpec(Array(DataType.integer), name) for name in
                     ("input_ids", "labels", "position_ids", "segment_ids")])
    source = dataset_source(version_uri)
    dataset = MetaDataset(source=source, name=f"rayline-{manifest['version']}", digest=manifest["version"], schema=schema)
    mlflow.log_input(dataset, context="prepared")
    mlflow.set_tags({"rayline.dataset_rows": str(manifest["splits"]["train"]["rows"]),
                     "rayline.tokenizer_hash": manifest["tokenizer"]["hash"][:16]})


def log_manifest(manifest_uri: str) -> None:
    import mlflow

    from core import storage

    mlflow.log_text(storage.read_text(manifest_uri), "manifest.json")
