"""An Apache Iceberg table as the data stage's input, pinned to one snapshot and read with Ray Data's `read_iceberg`.

The driver resolves the table once (`resolve_table`, pyiceberg): the catalog, the snapshot (the configured one, or
the current one at that moment), the schema the mapping and key name, and the data files the row filter leaves. The
read is pinned to that snapshot id, which goes into the dataset version with the table's uuid, the filter and the
mapping: the same snapshot is the same version and the same rows; a newer snapshot is a new version.

Each row becomes a raw line as a file's line does (data/sources.py LINES_SCHEMA): its columns renamed by the
mapping and written as one JSON object, which then goes through the same validation, dedup, rejects and tokenizing
as a JSONL line. A table row has no line number, and Ray's reader does not say which data file or position a row
came from, so a row is named by its `key_column`: `source` is `iceberg:<table>@<snapshot>` and `line` the key's
value (-1 for a row whose key is null). That is what a reject shows.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from dataclasses import asdict, dataclass
from typing import Callable

import pyarrow as pa

from data.config import IcebergCatalog, IcebergTable
from data.sources import LINES_SCHEMA
from core import storage

KIND = "iceberg"  # the raw lines' kind: a JSON object, as a Parquet row's is


@dataclass(frozen=True)
class TableRead:
    """The table as the driver resolved it: what the read tasks need and what the manifest records."""

    table: str
    snapshot_id: int
    table_uuid: str
    location: str
    catalog: dict[str, str]  # pyiceberg's catalog properties; no credentials (those come from each process's env)
    columns: dict[str, str]
    key_column: str
    row_filter: str
    data_files: int
    bytes: int
    kind: str = KIND
    """`iceberg`, or `delta` for a Delta table (data/delta_source.py: `table` its URI, `snapshot_id` its version)."""

    @property
    def source(self) -> str:
        """The rejects' `source` of its rows and its entry in the manifest's sources."""
        return f"{self.kind}:{self.table}@{self.snapshot_id}"

    def identity(self) -> str:
        """What the dataset version hashes for the table: the rows it gives, not where the catalog is."""
        blob = json.dumps({"table_uuid": self.table_uuid, "snapshot_id": self.snapshot_id,
                           "row_filter": self.row_filter, "columns": self.columns, "key_column": self.key_column},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def manifest_entry(self) -> dict:
        entry = asdict(self)
        entry["catalog"] = {k: v for k, v in self.catalog.items() if not k.startswith("s3.")}
        return entry


def catalog_properties(catalog: IcebergCatalog) -> dict[str, str]:
    """pyiceberg's properties for the catalog. A warehouse on s3:// gets the endpoint and region of the AWS_*
    environment (core/storage.py) and path-style addressing; its keys stay in the environment, where pyarrow's S3
    client reads them in every process, so they never travel with the read tasks."""
    props = {"name": catalog.name, "type": catalog.type, "uri": catalog.uri, "warehouse": catalog.warehouse}
    if storage.is_s3(catalog.warehouse):
        fs = storage.s3_filesystem()
        props["s3.region"] = fs.region
        if endpoint := storage.s3_endpoint():
            props["s3.endpoint"] = endpoint
            props["s3.force-virtual-addressing"] = "false"
    return props


def parse_filter(text: str, field: str = "iceberg.row_filter"):
    """The row filter as a pyiceberg expression (AlwaysTrue when empty); a ValueError names what is wrong (as
    `field`: a Delta table's filter has the same syntax)."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.expressions.parser import parse
    from pyparsing import ParseException

    if not text.strip():
        return AlwaysTrue()
    try:
        return parse(text)
    except ParseException as e:
        raise ValueError(f"{field}: {text!r} is not pyiceberg's filter syntax at character {e.loc + 1} "
                         "(for example: lang = 'en' and id > 10)") from None


_COMPARISONS = {"EqualTo": operator.eq, "NotEqualTo": operator.ne, "LessThan": operator.lt,
                "LessThanOrEqual": operator.le, "GreaterThan": operator.gt, "GreaterThanOrEqual": operator.ge}


def ray_filter(expr, field: str = "iceberg.row_filter"):
    """A parsed filter as a Ray Data expression, or None for AlwaysTrue. `Dataset.filter(expr=...)` is Ray's way to
    filter a read (read_iceberg's `row_filter` is deprecated in 2.60); Ray pushes it back into the Iceberg scan."""
    from pyiceberg import expressions as ie
    from ray.data.expressions import col, lit

    if isinstance(expr, ie.AlwaysTrue):
        return None
    if isinstance(expr, ie.And):
        return ray_filter(expr.left, field) & ray_filter(expr.right, field)
    if isinstance(expr, ie.Or):
        return ray_filter(expr.left, field) | ray_filter(expr.right, field)
    if isinstance(expr, ie.Not):
        return ~ray_filter(expr.child, field)
    name = type(expr).__name__
    if name in _COMPARISONS:
        return _COMPARISONS[name](col(expr.term.name), lit(expr.literal.value))
    if isinstance(expr, (ie.In, ie.NotIn)):
        values = sorted(v.value for v in expr.literals)
        return col(expr.term.name).is_in(values) if isinstance(expr, ie.In) else col(expr.term.name).not_in(values)
    if isinstance(expr, (ie.IsNull, ie.NotNull)):
        return col(expr.term.name).is_null() if isinstance(expr, ie.IsNull) else col(expr.term.name).is_not_null()
    raise ValueError(f"{field}: {name} is not supported here; use comparisons (= != < <= > >=), in, "
                     "not in, is null, is not null, and, or, not")


def check_columns(prefix: str, table: str, at: str, names: list[str], key_column: str,
                  columns: dict[str, str]) -> None:
    """The key and every mapped column exist in the table (`names`, its columns `at` the pinned snapshot or
    version), and no mapped name is one of its unmapped columns; a ValueError names the `prefix.` field."""
    named = [(key_column, f"{prefix}.key_column"), *((c, f"{prefix}.columns.{c}") for c in columns)]
    for column, field in named:
        if column not in names:
            raise ValueError(f"{field}: {table} has no column {column!r} at {at} (its columns: {', '.join(names)})")
    clash = sorted(set(columns.values()) & (set(names) - set(columns)))
    if clash:
        raise ValueError(f"{prefix}.columns: {clash[0]!r} is already a column of {table}; map that column too, "
                         "or map to another field")


def resolve_table(spec: IcebergTable) -> TableRead:
    """Load the table, pin its snapshot (the configured one, or the current one now) and check the config against
    the snapshot's schema; a ValueError names the field that is wrong and what the table has."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.types import IntegerType, LongType

    database = spec.catalog.uri[len("sqlite:///"):]
    if not os.path.isfile(database):  # pyiceberg would make an empty catalog there and find no table in it
        raise ValueError(f"iceberg.catalog.uri: no catalog database at {os.path.abspath(database)}")
    props = catalog_properties(spec.catalog)
    catalog = load_catalog(spec.catalog.name, **{k: v for k, v in props.items() if k != "name"})
    try:
        table = catalog.load_table(spec.table)
    except NoSuchTableError:
        raise ValueError(f"iceberg.table: {spec.table} is not in the catalog {spec.catalog.uri} (its tables: "
                         f"{', '.join(_tables(catalog)) or 'none'})") from None
    snapshot = table.snapshot_by_id(spec.snapshot_id) if spec.snapshot_id else table.current_snapshot()
    if snapshot is None:
        known = ", ".join(str(s.snapshot_id) for s in table.snapshots()) or "none: nothing was ever written to it"
        what = f"has no snapshot {spec.snapshot_id}" if spec.snapshot_id else "has no current snapshot"
        raise ValueError(f"iceberg.snapshot_id: {spec.table} {what} (its snapshots: {known})")
    row_filter = parse_filter(spec.row_filter)
    ray_filter(row_filter)  # an unsupported filter fails here, before any work
    scan = table.scan(row_filter=row_filter, snapshot_id=snapshot.snapshot_id)
    schema = scan.projection()
    names = [f.name for f in schema.fields]
    check_columns("iceberg", spec.table, f"snapshot {snapshot.snapshot_id}", names, spec.key_column, spec.columns)
    key_type = schema.find_field(spec.key_column).field_type
    if not isinstance(key_type, (IntegerType, LongType)):
        raise ValueError(f"iceberg.key_column: {spec.key_column} is {key_type}; name an int or long column that "
                         "identifies a row (it is the rejects' line)")
    try:
        files = [task.file for task in scan.plan_files()]
    except ValueError as e:  # the filter names a column the table lacks, or compares it with the wrong type
        raise ValueError(f"iceberg.row_filter: {spec.row_filter!r}: {e}") from None
    return TableRead(spec.table, snapshot.snapshot_id, str(table.metadata.table_uuid), table.location(), props,
                     dict(spec.columns), spec.key_column, spec.row_filter, len(files),
                     sum(f.file_size_in_bytes for f in files))


def _tables(catalog) -> list[str]:
    return [".".join(t) for ns in catalog.list_namespaces() for t in catalog.list_tables(ns)]


def to_lines(batch: pa.Table, read: TableRead) -> pa.Table:
    """Table rows -> raw lines (LINES_SCHEMA): each row a JSON object with the mapped field names, its key as line."""
    keys = [-1 if k is None else k for k in batch[read.key_column].to_pylist()]
    rows = batch.rename_columns([read.columns.get(c, c) for c in batch.column_names]).to_pylist()
    n = len(rows)
    return pa.table({
        "source": pa.array([read.source] * n, pa.string()), "line": pa.array(keys, pa.int64()),
        "raw": pa.array([json.dumps(r, ensure_ascii=False, default=str).encode("utf-8") for r in rows],
                        pa.large_binary()),
        "kind": pa.array([read.kind] * n, pa.string()), "split": pa.array([0] * n, pa.int8()),
    }, schema=LINES_SCHEMA)


def block_name(lines: pa.Table) -> str:
    """A name for a block's shuffle files fixed by its rows: a retried task rewrites its own files, and two blocks
    whose first rows share a key (keys need not be unique) do not write over each other's."""
    h = hashlib.blake2b(digest_size=8)
    h.update(lines["line"].to_numpy().tobytes())
    for raw in lines["raw"].to_pylist():
        h.update(raw)
    return h.hexdigest()


def shuffle_rows(batch: pa.Table, read: TableRead, transform: Callable[[pa.Table], pa.Table],
                 sink: Callable[..., pa.Table]) -> pa.Table:
    """The per-block work of the read: rows -> lines -> examples (`transform`) -> shuffle files (`sink`), as
    data.datasource.LinesDatasource does for files; returns the sink's rows (the files written)."""
    lines = to_lines(batch, read)
    return sink([transform(lines)], name=block_name(lines))


def read_table(read: TableRead, on_block: Callable[[pa.Table], pa.Table]):
    """A Ray dataset of `on_block`'s results over the table at its pinned snapshot (Ray Data's read_iceberg)."""
    import ray

    ds = ray.data.read_iceberg(table_identifier=read.table, snapshot_id=read.snapshot_id,
                               catalog_kwargs=dict(read.catalog))
    if (expr := ray_filter(parse_filter(read.row_filter))) is not None:
        ds = ds.filter(expr=expr)
    return ds.map_batches(on_block, batch_format="pyarrow", batch_size=None)
