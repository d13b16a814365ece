"""The stage's Ray Data datasource: input files as raw lines, read in Ray tasks.

Kept apart from `data.prepare` so that read workers import only this, `data.sources` and pyarrow, not
the driver's MLflow and transformers imports.
"""

from __future__ import annotations

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from data.sources import LINES_SCHEMA, SourceFile, group_files, read_lines
from pipelines import storage


class LinesDatasource(Datasource):
    """Ray Data datasource over the input files: raw lines (see `data.sources.read_lines`), one read task
    per file, or per group of files when there are many small ones."""

    def __init__(self, files: list[SourceFile], block_rows: int = 8192):
        super().__init__()
        self.files = files
        self.block_rows = block_rows

    def estimate_inmemory_data_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def supports_distributed_reads(self) -> bool:
        # A local path exists on the driver's node only (unless it is a shared mount, which we cannot tell).
        return all(storage.is_remote(f.uri) for f in self.files)

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        tasks = []
        for group in group_files(self.files, parallelism):
            meta = BlockMetadata(num_rows=None, size_bytes=sum(f.size for f in group), exec_stats=None,
                                 input_files=[f.uri for f in group])

            def read(group=group, block_rows=self.block_rows):
                for f in group:
                    yield from read_lines(f, block_rows)

            tasks.append(ReadTask(read, meta, schema=LINES_SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks
