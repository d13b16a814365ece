"""The hand-off to training: a prepared version's manifest, and its splits as Ray Datasets.

    from data.prepared import read_split
    ds = read_split("s3://bucket/prepared/3f2a9c0d1e4b5a67/manifest.json", "train")

Rows hold `COLUMNS` (or the columns the manifest lists: a preference version's, data/preferences.py), each a
list<int32> of exactly the manifest's `seq_len`; training streams them as
they are, without re-tokenizing. Labels are aligned with input_ids the way Hugging Face models expect
(the model shifts them); build the attention mask from segment_ids so packed examples stay apart.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pyarrow as pa

from core import storage

if TYPE_CHECKING:
    import ray

__all__ = ["COLUMNS", "ROW_SCHEMA", "load_manifest", "read_split"]

COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
ROW_SCHEMA = pa.schema([(name, pa.list_(pa.int32())) for name in COLUMNS])


def load_manifest(manifest_or_dir_uri: str) -> dict:
    """The manifest at a `.../manifest.json` URI or in a version directory (local path or s3://)."""
    uri = str(manifest_or_dir_uri)
    if not uri.rstrip("/").endswith(".json"):
        uri = storage.join(uri.rstrip("/"), "manifest.json")
    try:
        manifest = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri}: no manifest; is this a prepared dataset version (run "
                                "python -m pipelines.prepare_data), and did that run finish?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{uri}: not a valid manifest ({e})") from None
    return manifest


def read_split(manifest_uri: str, split: str = "train") -> ray.data.Dataset:
    """A Ray Dataset over one split's Parquet shards (`COLUMNS`, or the manifest's `columns`), read through
    `storage.resolve`."""
    import ray  # here, not at module import: importing Ray fixes its connection settings for the process

    manifest = load_manifest(manifest_uri)
    if split not in manifest["splits"]:
        raise KeyError(f"{manifest_uri}: no split {split!r} (splits: {', '.join(manifest['splits'])})")
    info = manifest["splits"][split]
    if info["rows"] == 0:
        return ray.data.from_arrow(ROW_SCHEMA.empty_table())
    fs, path = storage.resolve(info["path"])
    from core.ray_cluster import read_parquet

    files = [f for f in storage.list_files(info["path"]) if f.endswith(".parquet")]
    # One block per shard file, whatever the cluster: left to itself, Ray Data sizes a read by the cluster's
    # CPUs, and the blocks decide which rows each training worker's split gets, so the same seed and data
    # would train differently on a cluster that has more (or fewer) nodes, e.g. after a node was lost.
    return read_parquet(path, filesystem=fs, file_extensions=["parquet"],
                        override_num_blocks=max(1, len(files))).select_columns(list(manifest.get("columns", COLUMNS)))
