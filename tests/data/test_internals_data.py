"""Guards for the undocumented MLflow function that data/ relies on (docs/INTERNALS.md, row D1). Fast: imports only,
no server. MLflow 3.17.2 at the time of writing."""

from __future__ import annotations

import inspect


def test_prepared_dataset_source_is_resolved_by_mlflows_registry():
    """D1, data/tracking.py `log_outcome`: mlflow.data.dataset_source_registry.resolve_dataset_source (not in
    mlflow.data's documented API) takes the prepared version's URI, local or s3://, and returns the DatasetSource
    that MetaDataset records, with the URI as it was given."""
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    assert list(inspect.signature(resolve_dataset_source).parameters)[0] == "raw_source"
    for uri in ("/tmp/rayline/datasets/v1", "s3://rayline/datasets/v1"):
        source = resolve_dataset_source(uri)
        assert isinstance(source, DatasetSource) and source.to_dict() == {"uri": uri}, (uri, source)
