"""The batch stage's input: JSONL lines or Parquet rows, each read with its `source`, the place it came from.

`source` is `<file>:<line>` for a JSONL line (1-based, as an editor counts them) and `<file>#<row>` for a
Parquet row (0-based), `<file>` relative to `input_uri`. It is unique and the same in every run over the
same input, which is what Ray Data's job-level checkpoint (`ray.data.checkpoint`) keys the done rows on: a
job started again after a crash skips the sources already written (pipeline.py). It also tells a user
which line a refused row was, and `id`s, which users choose, may repeat.

A job that answers with more than one model (`adapters`, `compare`) reads every row once per model: each copy carries the model's
label in `model_version` and in its source (`prompts.jsonl:3@rayline-tiny-arith/2`), so the checkpoint's key
stays unique and a resumed job answers exactly the (row, model) pairs not written yet.

JSONL is split on "\\n" only and decoded a line at a time: a line that is not UTF-8 becomes one refused row
(text null), not a failed read, and a line separator inside a JSON string (U+2028) does not split a record,
as Python's `splitlines` (Ray's `read_text`) would.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Iterator

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.data
from ray.data.datasource.file_based_datasource import FileBasedDatasource

from core import storage
from serve.online import engine as eng
from serve.batch.config import Config
from serve.batch.rows import MODEL_COLUMN, SOURCE_COLUMN

JSONL_EXTENSIONS = ("jsonl", "json", "ndjson")
READ_CHUNK_BYTES = 4 << 20
"""JSONL is read this many bytes at a time; each chunk's whole lines are one block."""
PARQUET_BATCH_ROWS = 4096
JSONL_SCHEMA = pa.schema([(SOURCE_COLUMN, pa.string()), ("text", pa.string())])


def input_format(cfg: Config) -> str:
    """`jsonl` or `parquet`: as configured, else from the file extension(s) under input_uri."""
    if cfg.input_format != "auto":
        return cfg.input_format
    fs, path = storage.resolve(cfg.input_uri)
    files = [PurePosixPath(path).name] if fs.get_file_info(path).is_file else storage.list_files(cfg.input_uri)
    if not files:
        raise FileNotFoundError(f"input_uri {cfg.input_uri}: no such file, or an empty directory")
    exts = {PurePosixPath(f).suffix.lstrip(".").lower() for f in files if not PurePosixPath(f).name.startswith(".")}
    if exts <= set(JSONL_EXTENSIONS):
        return "jsonl"
    if exts == {"parquet"}:
        return "parquet"
    raise ValueError(
        f"input_uri {cfg.input_uri}: cannot tell the format from extensions {sorted(exts)}; "
        "set input_format: jsonl or parquet"
    )


def input_files(cfg: Config, fmt: str) -> list[str]:
    """The URIs of the files the job reads: input_uri itself, or the files under it with the format's
    extension (any name when `input_format: jsonl` is said outright), in name order."""
    fs, root = storage.resolve(cfg.input_uri)
    if fs.get_file_info(root).type == pafs.FileType.File:
        return [cfg.input_uri]
    exts = (".parquet",) if fmt == "parquet" else tuple("." + e for e in JSONL_EXTENSIONS)
    return [
        storage.join(cfg.input_uri, rel) for rel in sorted(storage.list_files(cfg.input_uri))
        if not PurePosixPath(rel).name.startswith(".")
        and (rel.lower().endswith(exts) or (fmt == "jsonl" and cfg.input_format == "jsonl"))
    ]


def read_blocks(cfg: Config, input_bytes: int) -> int:
    """Blocks to read the input as: Ray Data's own choice (about one per MiB, at most 200) but never fewer than
    two a batch slot of every engine. A 512-prompt file is otherwise 4 blocks, and an engine task a whole block
    (four batches): the first engine up takes every block while the others are still loading."""
    slots = cfg.num_engines * cfg.max_concurrent_batches
    return max(2 * slots, min(200, math.ceil(input_bytes / eng.MiB)))


def read_inputs(cfg: Config, fmt: str, models: list[str] | None = None) -> ray.data.Dataset:
    """The input rows, each with its `source`: `text` per JSONL line, or the Parquet row's own columns; with
    `models` (labels: a job that answers with more than one model), each row once per model, the label in
    `model_version` and in the source."""
    files = input_files(cfg, fmt)
    if not files:
        raise FileNotFoundError(f"input_uri {cfg.input_uri}: no {fmt} files under it")
    fs, root = storage.resolve(cfg.input_uri)
    paths = [storage.resolve(uri)[1] for uri in files]
    models = models or None
    # Copies made as the files are read, where Ray Data's job checkpoint filters the rows already written; a job
    # with `limit` (never resumable) takes its first rows before they are copied.
    source = PromptFiles(paths, root=root, fmt=fmt, models=None if cfg.limit else models, filesystem=fs)
    remote_args = {"num_cpus": cfg.cpu_stage_num_cpus}
    ds = ray.data.read_datasource(
        source, override_num_blocks=read_blocks(cfg, storage.total_bytes(cfg.input_uri)), ray_remote_args=remote_args,
    )
    if not cfg.limit:
        return ds
    ds = ds.limit(cfg.limit)
    return ds.map_batches(per_model, fn_args=(models,), batch_format="pyarrow", **remote_args) if models else ds


def count_input_rows(cfg: Config, fmt: str) -> int:
    """Rows the job will answer: Parquet footers' row counts, or JSONL lines (non-blank), capped by `limit`, once
    per model (the base, each adapter, each compared model). A Parquet file with a column named `source` (or
    `model_version`, in a job with several models) is refused here, before any engine starts."""
    total = 0
    reserved = {SOURCE_COLUMN: "each result's input position (<file>#<row>)"}
    if cfg.adapters or cfg.compare:
        reserved[MODEL_COLUMN] = "the model that answered each row"
    for uri in input_files(cfg, fmt):
        if fmt == "jsonl":
            total += _non_empty_lines(*storage.resolve(uri))
            continue
        meta = storage.parquet_metadata(uri)
        for name, what in reserved.items():
            if name in meta.schema.names:
                raise ValueError(f"{uri}: has a column `{name}`, the name rayline gives {what}; rename that column")
        total += meta.num_rows
    return (min(total, cfg.limit) if cfg.limit else total) * (1 + len(cfg.adapters) + len(cfg.compare))


def _non_empty_lines(fs, path: str, chunk: int = 8 << 20) -> int:
    """Lines with something on them (what the reader keeps), read in chunks."""
    n, tail = 0, b""
    with fs.open_input_stream(path) as f:
        while data := f.read(chunk):
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            n += sum(1 for line in lines if line.strip())
    return n + (1 if tail.strip() else 0)


def relative_name(path: str, root: str) -> str:
    """`path` relative to the input root (its own name when the input is one file)."""
    rel = path[len(root):].lstrip("/") if path.startswith(root.rstrip("/") + "/") else ""
    return rel or PurePosixPath(path).name


def jsonl_block(lines: list[bytes], first_line: int, name: str) -> pa.Table:
    """Lines numbered from `first_line` -> rows of (source, text), blank lines left out; a line that is not
    UTF-8 keeps its source with text null (the validator refuses it)."""
    sources, texts = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        line = first_line + i
        if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark (Windows tools write one)
            raw = raw[3:]
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            text = None
        sources.append(f"{name}:{line}")
        texts.append(text)
    return pa.table([sources, texts], schema=JSONL_SCHEMA)


def jsonl_rows(f, name: str) -> Iterator[pa.Table]:
    """A JSONL stream -> blocks of (source, text), a chunk of whole lines at a time."""
    line, tail = 1, b""
    while data := f.read(READ_CHUNK_BYTES):
        lines = (tail + data).split(b"\n")
        tail = lines.pop()
        if lines:
            yield jsonl_block(lines, line, name)
            line += len(lines)
    if tail:
        yield jsonl_block([tail], line, name)


def parquet_rows(f, name: str) -> Iterator[pa.Table]:
    """A Parquet file -> its rows with their source, PARQUET_BATCH_ROWS at a time."""
    row = 0
    for batch in pq.ParquetFile(f).iter_batches(batch_size=PARQUET_BATCH_ROWS):
        sources = pa.array([f"{name}#{row + i}" for i in range(batch.num_rows)], pa.string())
        row += batch.num_rows
        yield pa.Table.from_batches([batch]).append_column(SOURCE_COLUMN, sources)


def per_model(block: pa.Table, models: list[str]) -> pa.Table:
    """A block's rows once per model label, each copy's source suffixed `@<label>` and the label in
    `model_version`."""
    sources = block.column(SOURCE_COLUMN)
    copies = []
    for label in models:
        copy = block.set_column(block.schema.get_field_index(SOURCE_COLUMN), SOURCE_COLUMN,
                                pa.compute.binary_join_element_wise(sources, pa.scalar(label), "@"))
        copies.append(copy.append_column(MODEL_COLUMN, pa.array([label] * block.num_rows, pa.string())))
    return pa.concat_tables(copies)


class PromptFiles(FileBasedDatasource):
    """JSONL or Parquet prompt files -> rows with their `source` (streamed: a chunk or row group at a time); with
    `models`, each row once per model (per_model)."""

    def __init__(self, paths: list[str], *, root: str, fmt: str, models: list[str] | None = None, **kwargs):
        super().__init__(paths, **kwargs)
        self.root, self.fmt, self.models = root, fmt, models

    def _open_input_source(self, filesystem, path: str, **open_args):
        if self.fmt == "parquet":  # the footer is at the end: random access
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
        rows = parquet_rows if self.fmt == "parquet" else jsonl_rows
        for block in rows(f, relative_name(path, self.root)):
            yield per_model(block, self.models) if self.models else block
