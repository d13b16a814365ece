"""The near-dedup step between the read phase and the shard tasks: one task per band partition (data/near_dedup.py).

It reads the band rows every read task wrote for its partition, finds the near copies in them, and writes them, by
the shard of the example removed, to `_shuffle/near-<shard>/<partition>.arrow` (data/shuffle.py), named by the
partition so a retried task rewrites its own files.
"""

from __future__ import annotations

import pyarrow as pa

from data.heap import keep_freed_memory
from data.near_dedup import near_duplicates
from data.shuffle import NEAR, partition_uri, read_partition
from core import storage


def find_near_copies(uris: list[str], partition: int, num_shards: int, version_uri: str) -> list[dict]:
    """The band-partition task: its band files -> near-copy files per shard; returns a row (as data.shuffle's
    FILES_SCHEMA) per file written."""
    keep_freed_memory()
    found = near_duplicates(read_partition(uris), num_shards)
    out = []
    for shard, table in sorted(found.items()):
        uri = partition_uri(version_uri, NEAR, shard, f"{partition:05d}")
        fs, path = storage.resolve(uri)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        out.append({"part": shard, "uri": uri, "rows": table.num_rows, "kind": NEAR})
    return out
