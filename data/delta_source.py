"""A Delta Lake table as the data stage's input, pinned to one version of its log and read with Ray Data's
`read_delta`.

The driver resolves the table once (`resolve_delta`, the `deltalake` library): the version (the configured one, or
the current one at that moment), the schema the mapping and key name, and the data files of that version. The
read is pinned to that version, which goes into the dataset version with the table's id, the filter and the
mapping: the same version is the same version of the dataset and the same rows; a newer table version is a new
dataset version. Rows then go the Iceberg reader's way (data/iceberg_source.py): each row a raw JSON line named by
its `key_column`, `source` `delta:<uri>@<version>`, filtered by the same filter syntax.

On s3:// the table is read with the process's own AWS_* variables: `deltalake` takes the endpoint and region as
storage options, and the read tasks get a pyarrow S3 filesystem built without keys, which finds them in each
process's environment, so no key travels with a task.
"""

from __future__ import annotations

import os
from typing import Callable

import pyarrow as pa

from core import storage
from data.config import DeltaSource
from data.iceberg_source import TableRead, check_columns, parse_filter, ray_filter

KIND = "delta"
FILTER_FIELD = "delta.row_filter"


def storage_options(uri: str) -> dict[str, str]:
    """`deltalake`'s options for the table's store: for s3://, the endpoint and region of the AWS_* environment
    (core/storage.py), plain HTTP where the endpoint is, and no keys (the library reads them from the environment)."""
    if not storage.is_s3(uri):
        return {}
    options = {"AWS_REGION": storage.s3_region()}
    if endpoint := storage.s3_endpoint():
        options["AWS_ENDPOINT_URL"] = endpoint
        options["AWS_ALLOW_HTTP"] = str(endpoint.startswith("http://")).lower()
    return options


def resolve_delta(spec: DeltaSource) -> TableRead:
    """Open the table, pin its version (the configured one, or the current one now) and check the config against that
    version's schema; a ValueError names the field that is wrong and what the table has."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    uri = spec.uri if storage.is_s3(spec.uri) or "://" in spec.uri else os.path.abspath(spec.uri)
    options = storage_options(uri)
    try:
        table = DeltaTable(uri, storage_options=options or None)
    except TableNotFoundError:
        raise ValueError(f"delta.uri: no Delta table at {uri} (no _delta_log there)") from None
    current = table.version()
    if spec.version > current:
        raise ValueError(f"delta.version: {uri} has no version {spec.version} (its versions: 0 .. {current})")
    version = current if spec.version < 0 else spec.version
    if version != current:
        table = DeltaTable(uri, version=version, storage_options=options or None)
    schema = table.schema().to_arrow()
    check_columns("delta", uri, f"version {version}", list(schema.names), spec.key_column, spec.columns)
    key_type = pa.field(schema.field(spec.key_column)).type
    if not pa.types.is_integer(key_type):
        raise ValueError(f"delta.key_column: {spec.key_column} is {key_type}; name an integer column that identifies "
                         "a row (it is the rejects' line)")
    ray_filter(parse_filter(spec.row_filter, FILTER_FIELD), FILTER_FIELD)  # an unsupported filter fails here
    actions = table.get_add_actions(flatten=True)
    sizes = pa.table(actions).column("size_bytes").to_pylist() if len(actions) else []
    return TableRead(uri, version, str(table.metadata().id), uri, options, dict(spec.columns), spec.key_column,
                     spec.row_filter, len(sizes), int(sum(sizes)), kind=KIND)


def read_delta_table(read: TableRead, on_block: Callable[[pa.Table], pa.Table]):
    """A Ray dataset of `on_block`'s results over the table at its pinned version (Ray Data's read_delta)."""
    import ray

    filesystem = None
    if storage.is_s3(read.location):  # deltalake's pyarrow dataset names files relative to the table's folder
        import pyarrow.fs as pafs

        bucket_path = read.location[len("s3://"):].rstrip("/")
        filesystem = pafs.SubTreeFileSystem(bucket_path, storage.s3_filesystem(keys=False))
    ds = ray.data.read_delta(read.location, version=read.snapshot_id, storage_options=dict(read.catalog) or None,
                             filesystem=filesystem)
    if (expr := ray_filter(parse_filter(read.row_filter, FILTER_FIELD), FILTER_FIELD)) is not None:
        ds = ds.filter(expr=expr)
    return ds.map_batches(on_block, batch_format="pyarrow", batch_size=None)

