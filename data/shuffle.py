"""The stage's shuffle by content hash, through the version's own storage instead of Ray's object store.

Dedup needs every copy of an example in one place, so no shard can be built before every record is read. Held in
the object store, that whole intermediate (every rendered example) is in memory before the first shard task starts,
and the store fills up to its cap and spills. Here each read task streams its examples, block by block, into one
Arrow IPC file per shard it has rows for:

    <version>/_shuffle/part-<shard>/<task>.arrow

and each shard task reads the files of its shard. With near_dedup, each task also writes its examples' LSH band
rows by band key (data/near_dedup.py) to `_shuffle/bands-<partition>/<task>.arrow`; one task per band partition
writes the near copies it finds to `_shuffle/near-<shard>/<partition>.arrow`, for the shard tasks to drop. A read task holds one block at a time, a shard task one shard, so
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
from data.near_dedup import band_rows
from core import storage

SHUFFLE_DIR = "_shuffle"
FILES_SCHEMA = pa.schema([("part", pa.int32()), ("uri", pa.string()), ("rows", pa.int64()), ("kind", pa.string())])
EXAMPLES, BANDS, NEAR = "part", "bands", "near"  # the kinds of shuffle file, and their folders' prefixes


def shuffle_uri(version_uri: str) -> str:
    return storage.join(version_uri, SHUFFLE_DIR)


def _task_name(block: pa.Table) -> str:
    return location_digest(block["source"][0].as_py(), block["line"][0].as_py()).hex()


def _pieces(block: pa.Table, parts: np.ndarray) -> Iterable[tuple[int, pa.Table]]:
    """(part, its rows) for every part (`parts`: one per row) the block has rows for, rows in block order."""
    if (parts == parts[0]).all():
        yield int(parts[0]), block
        return
    order = np.argsort(parts, kind="stable")
    ordered, block = parts[order], block.take(order)
    starts = np.flatnonzero(np.diff(ordered)) + 1
    for start, stop in zip([0, *starts.tolist()], [*starts.tolist(), len(ordered)]):
        yield int(ordered[start]), block.slice(start, stop - start)


class _Writers:
    """One Arrow IPC file per (kind, partition) a read task has rows for, opened on first use."""

    def __init__(self, version_uri: str):
        self.version_uri = version_uri
        self.open: dict[tuple[str, int], tuple] = {}  # (kind, part) -> (output stream, IPC writer)
        self.uris: dict[tuple[str, int], str] = {}
        self.rows: dict[tuple[str, int], int] = {}

    def write(self, kind: str, part: int, piece: pa.Table, name: str) -> None:
        at = (kind, part)
        if at not in self.open:
            self.uris[at] = partition_uri(self.version_uri, kind, part, name)
            fs, path = storage.resolve(self.uris[at])
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            sink = fs.open_output_stream(path)
            self.open[at] = (sink, pa.ipc.new_file(sink, piece.schema))
            self.rows[at] = 0
        self.open[at][1].write_table(piece)
        self.rows[at] += piece.num_rows

    def close(self) -> pa.Table:
        for sink, writer in self.open.values():
            writer.close()
            sink.close()
        done = sorted(self.open)
        return pa.Table.from_arrays([pa.array([p for _, p in done], pa.int32()), pa.array([self.uris[d] for d in done]),
                                     pa.array([self.rows[d] for d in done], pa.int64()),
                                     pa.array([k for k, _ in done], pa.string())], schema=FILES_SCHEMA)


def partition_uri(version_uri: str, kind: str, part: int, name: str) -> str:
    return storage.join(shuffle_uri(version_uri), f"{kind}-{part:05d}", f"{name}.arrow")


def write_partitions(blocks: Iterable[pa.Table], version_uri: str, band_partitions: int = 0,
                     name: str | None = None) -> pa.Table:
    """Append each block's rows to its shard's file (one per shard for the task) and, with `band_partitions`, its
    band rows to their band partitions' files; returns a FILES_SCHEMA row per file written. The files are named
    `name`, by default after the task's first record (see the module docstring)."""
    keep_freed_memory()
    writers = _Writers(version_uri)
    try:
        for block in blocks:
            if not block.num_rows:
                continue
            name = name or _task_name(block)
            if band_partitions:
                bands = band_rows(block)
                if bands.num_rows:
                    parts = (bands["band"].to_numpy() % np.uint64(band_partitions)).astype(np.int32)
                    for part, piece in _pieces(bands, parts):
                        writers.write(BANDS, part, piece, name)
            if "bands" in block.column_names:  # they travel in the band files, not with the examples
                block = block.drop_columns(["bands"])
            for part, piece in _pieces(block, block["part"].to_numpy()):
                writers.write(EXAMPLES, part, piece, name)
    finally:
        files = writers.close()
    return files


def read_partition(uris: list[str]) -> pa.Table:
    """One shard's rows: every read task's file of it, in the order given."""
    tables = []
    for uri in uris:
        fs, path = storage.resolve(uri)
        with fs.open_input_file(path) as f:
            tables.append(pa.ipc.open_file(f).read_all())
    return pa.concat_tables(tables)
