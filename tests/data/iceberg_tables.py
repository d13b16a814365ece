"""A real Iceberg table for the data-stage tests: pyiceberg's SQL catalog on SQLite, written in two snapshots.

Rows are question/answer pairs with an integer `id` and a `lang` column; snapshot 1 holds FIRST (one of them with
an empty answer, which the instruction format rejects), snapshot 2 appends SECOND.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA = pa.schema([("id", pa.int64()), ("question", pa.string()), ("answer", pa.string()), ("lang", pa.string())])
BAD_ID = 7  # its answer is empty: rejected as empty_text
FIRST = [(i, f"What is {i} plus {i}?", "" if i == BAD_ID else f"It is {2 * i}.", "de" if i % 5 == 0 else "en")
         for i in range(1, 21)]
SECOND = [(i, f"What is {i} times three?", f"It is {3 * i}.", "en") for i in range(101, 111)]


def catalog_spec(root: str, warehouse: str | None = None) -> dict:
    """The config's `iceberg.catalog` for a catalog database under `root` (a local folder)."""
    return {"uri": f"sqlite:///{root}/catalog.db", "warehouse": warehouse or f"file://{root}/warehouse",
            "name": "tests"}


def write_table(catalog: dict, table: str = "chats.qa") -> list[int]:
    """Create `table` and append FIRST, then SECOND: returns the two snapshot ids, oldest first."""
    from pyiceberg.catalog import load_catalog

    from data.config import IcebergCatalog
    from data.iceberg_source import catalog_properties

    props = catalog_properties(IcebergCatalog(**catalog))  # an s3:// warehouse: the stack's endpoint, as the stage's
    cat = load_catalog(props.pop("name"), **props)
    namespace = table.split(".")[0]
    cat.create_namespace_if_not_exists(namespace)
    t = cat.create_table(table, schema=SCHEMA)
    snapshots = []
    for rows in (FIRST, SECOND):
        t.append(pa.table(list(zip(*rows)), schema=SCHEMA))
        snapshots.append(t.current_snapshot().snapshot_id)
    return snapshots


def rows(*batches: list[tuple], lang: str | None = None) -> list[tuple]:
    """The rows of `batches` (FIRST, SECOND), only those in `lang` when given."""
    return [r for batch in batches for r in batch if lang is None or r[3] == lang]
