"""The prepared version's MLflow dataset source comes from mlflow.data.sources, by the URI's scheme."""

import pytest
from mlflow.data.sources import LocalArtifactDatasetSource, S3ArtifactDatasetSource

from data.tracking import dataset_source


@pytest.mark.parametrize("uri, kind", [("/tmp/rayline/datasets/v1", LocalArtifactDatasetSource),
                                       ("s3://rayline/datasets/v1", S3ArtifactDatasetSource)])
def test_the_source_records_the_uri_as_given(uri, kind):
    source = dataset_source(uri)
    assert type(source) is kind and source.to_dict() == {"uri": uri}
