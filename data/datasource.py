"""The stage's Ray Data datasource: input files as raw lines, read in Ray tasks.

Kept apart from `data.prepare` so that read workers import only this, `data.sources` and pyarrow, not
the driver's MLflow and transformers imports.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from data.sources import LINES_SCHEMA, FilePart, group_files, read_lines
from core import storage


def coalesce(blocks: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The same rows in blocks of at least `rows` (but the last): a group of many small files becomes a few
    blocks, so the per-block work (the transform's set-up, one write per shard) is paid per block, not per file."""
    pending: list[pa.Table] = []
    count = 0
    for block in blocks:
        pending.append(block)
        count += block.num_rows
        if count >= rows:
            yield pa.concat_tables(pending) if len(pending) > 1 else block
            pending, count = [], 0
    if count:
        yield pa.concat_tables(pending) if len(pending) > 1 else pending[0]


class LinesDatasource(Datasource):
    """Ray Data datasource over the input files: raw lines (see `data.sources.read_lines`), one read task
    per file or part of a big one, or per group of small files (their lines coalesced into blocks of `block_rows`). A `transform`
    runs on every block inside the read task (the stage's per-record work, fused with the read so no
    block crosses processes before it is done). A `sink` then takes the task's transformed blocks as they
    are made and returns the task's one block (the stage writes them to its shuffle files and returns
    where they went); without one, the task yields its blocks. `schema` is what the task returns."""

    def __init__(self, parts: list[FilePart], block_rows: int = 8192,
                 transform: Callable[[pa.Table], pa.Table] | None = None,
                 sink: Callable[[Iterator[pa.Table]], pa.Table] | None = None, schema: pa.Schema = LINES_SCHEMA):
        super().__init__()
        self.parts = parts
        self.block_rows = block_rows
        self.transform = transform
        self.sink = sink
        self.schema = schema

    def estimate_inmemory_data_size(self) -> int:
        return sum(f.size for f in self.parts)

    @property
    def supports_distributed_reads(self) -> bool:
        # A local path exists on the driver's node only (unless it is a shared mount, which we cannot tell).
        return all(storage.is_remote(f.file.uri) for f in self.parts)

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        tasks = []
        for group in group_files(self.parts, parallelism):
            meta = BlockMetadata(num_rows=None, size_bytes=sum(f.size for f in group), exec_stats=None,
                                 input_files=sorted({f.file.uri for f in group}))

            def read(group=group, block_rows=self.block_rows, transform=self.transform, sink=self.sink):
                lines = coalesce((b for f in group for b in read_lines(f, block_rows)), block_rows)
                blocks = (transform(b) if transform else b for b in lines)
                if sink:
                    yield sink(blocks)
                else:
                    yield from blocks

            tasks.append(ReadTask(read, meta, schema=self.schema, per_task_row_limit=per_task_row_limit))
        return tasks
