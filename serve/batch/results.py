"""The batch stage's result Parquet files, read back a batch of rows at a time."""

from __future__ import annotations

from core import storage


def result_batches(output_uri: str, columns: list[str], batch_rows: int = 65_536, skip: frozenset[str] = frozenset()):
    """The result Parquet files under output_uri (less the files named in `skip`, relative), a batch of rows at a
    time and only `columns`."""
    import pyarrow.dataset as pads

    fs, _ = storage.resolve(output_uri)
    files = [storage.resolve(storage.join(output_uri, rel))[1] for rel in sorted(storage.list_files(output_uri))
             if rel.endswith(".parquet") and rel not in skip]
    return pads.dataset(files, filesystem=fs, format="parquet").to_batches(columns=columns, batch_size=batch_rows)
