"""The stage's shuffle by content hash, through the version's own storage instead of Ray's object store.

Dedup needs every copy of an example in one place, so no shard can be built before every record is read. Held in
the object store, that whole intermediate (every rendered example) is in memory before the first shard task starts,
and the store fills up to its cap and spills. Here each read task streams its examples, block by block, into one
Arrow IPC file per shard it has rows for:

    <version>/_shuffle/part-<shard>/<task>.arrow

and each shard task reads the files of its shard. A read task holds one block at a time, a shard task one shard, so
memory stays the same however large the input (the files are on disk, or in object storage next to the output).
`<task>` is a hash of the task's first record (source and line), fixed by the input: a retried task rewrites its
own files instead of adding copies. The driver deletes `_shuffle` once every shard is written.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa

from data.examples import location_digest
from data.heap import keep_freed_memory
from core import storage

SHUFFLE_DIR = "_shuffle"
FILES_SCHEMA = pa.schema([("part", pa.int32()), ("uri", pa.string()), ("rows", pa.int64())])


def shuffle_uri(version_uri: str) -> str:
    return storage.join(version_uri, SHUFFLE_DIR)


def _task_name(block: pa.Table) -> str:
    return location_digest(block["source"][0].as_py(), block["line"][0].as_py()).hex()


def _pieces(block: pa.Table) -> Iterable[tuple[int, pa.Table]]:
    """(part, its rows) for every part the block has rows for, rows in block order."""
    parts = block["part"].to_numpy()
    if (parts == parts[0]).all():
        yield int(parts[0]), block
        return
    order = np.argsort(parts, kind="stable")
    ordered, block = parts[order], block.take(order)
    starts = np.flatnonzero(np.diff(ordered)) + 1
    for start, stop in zip([0, *starts.tolist()], [*starts.tolist(), len(ordered)]):
        yield int(ordered[start]), block.slice(start, stop - start)


def write_partitions(blocks: Iterable[pa.Table], version_uri: str) -> pa.Table:
    """Append each block's rows to its shard's file (one per shard for the task); returns a FILES_SCHEMA row per file."""
    keep_freed_memory()
    writers: dict[int, tuple] = {}  # part -> (output stream, IPC writer)
    uris: dict[int, str] = {}
    rows: dict[int, int] = {}
    name = None
    try:
        for block in blocks:
            if not block.num_rows:
                continue
            name = name or _task_name(block)
            for part, piece in _pieces(block):
                if part not in writers:
                    uris[part] = storage.join(shuffle_uri(version_uri), f"part-{part:05d}", f"{name}.arrow")
                    fs, path = storage.resolve(uris[part])
                    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
                    sink = fs.open_output_stream(path)
                    writers[part] = (sink, pa.ipc.new_file(sink, piece.schema))
                    rows[part] = 0
                writers[part][1].write_table(piece)
                rows[part] += piece.num_rows
    finally:
        for sink, writer in writers.values():
            writer.close()
            sink.close()
    parts = sorted(writers)
    return pa.Table.from_arrays([pa.array(parts, pa.int32()), pa.array([uris[p] for p in parts], pa.string()),
                                 pa.array([rows[p] for p in parts], pa.int64())], schema=FILES_SCHEMA)


def read_partition(uris: list[str]) -> pa.Table:
    """One shard's rows: every read task's file of it, in the order given."""
    tables = []
    for uri in uris:
        fs, path = storage.resolve(uri)
        with fs.open_input_file(path) as f:
            tables.append(pa.ipc.open_file(f).read_all())
    return pa.concat_tables(tables)
