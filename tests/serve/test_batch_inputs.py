"""The batch stage's reader (serve/batch/inputs.py): every row with its `source`, JSONL split on newlines only
and decoded a line at a time, Parquet rows numbered; the config checks of resuming. No Ray: the per-file
readers that the datasource's read tasks run are called directly (the real reads: test_batch_infer.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from core.config import ConfigError, from_dict
from serve.batch import inputs
from serve.batch.config import Config


def read_file(path, fmt: str, root: str) -> list[dict]:
    """What PromptFiles' read task yields for one file (the same functions, without Ray)."""
    fs = pafs.LocalFileSystem()
    rows = inputs.parquet_rows if fmt == "parquet" else inputs.jsonl_rows
    with (fs.open_input_file if fmt == "parquet" else fs.open_input_stream)(str(path)) as f:
        return [row for block in rows(f, inputs.relative_name(str(path), root)) for row in block.to_pylist()]


def test_jsonl_lines_keep_their_line_numbers_and_bad_bytes_become_one_row(tmp_path, monkeypatch):
    records = [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two\u2028still two"}, {"id": "c", "prompt": "3"}]
    raw = (b"\xef\xbb\xbf" + json.dumps(records[0]).encode() + b"\r\n\n   \n"
           + json.dumps(records[1], ensure_ascii=False).encode() + b"\n"
           + b'{"id": "bad", "prompt": "\xff\xfe"}\n'
           + json.dumps(records[2]).encode())  # no newline at the end
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "p.jsonl"
    path.write_bytes(raw)
    monkeypatch.setattr(inputs, "READ_CHUNK_BYTES", 7)  # lines cut across chunks keep their numbers
    rows = read_file(path, "jsonl", root=str(tmp_path))
    assert [r["source"] for r in rows] == ["d/p.jsonl:1", "d/p.jsonl:4", "d/p.jsonl:5", "d/p.jsonl:6"]
    assert json.loads(rows[0]["text"]) == records[0]  # no byte-order mark, no carriage return
    assert json.loads(rows[1]["text"]) == records[1]  # U+2028 inside a string does not end the record
    assert rows[2]["text"] is None and json.loads(rows[3]["text"]) == records[2]
    # The planned count is what the reader yields; a single-file input is named by its own name.
    cfg = from_dict(Config, {"input_uri": str(path), "output_uri": str(tmp_path / "out"), "engine": {"model": "m"}})
    assert inputs.count_input_rows(cfg, "jsonl") == len(rows)
    assert [r["source"] for r in read_file(path, "jsonl", root=str(path))][0] == "p.jsonl:1"


def test_parquet_rows_are_numbered_across_batches(tmp_path, monkeypatch):
    table = pa.table({"id": [f"r{i}" for i in range(10)], "prompt": [f"q{i}" for i in range(10)]})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=4)
    monkeypatch.setattr(inputs, "PARQUET_BATCH_ROWS", 3)
    rows = read_file(tmp_path / "p.parquet", "parquet", root=str(tmp_path))
    assert [(r["source"], r["id"], r["prompt"]) for r in rows] == [(f"p.parquet#{i}", f"r{i}", f"q{i}") for i in range(10)]


def test_a_parquet_column_named_source_is_refused_before_any_engine(tmp_path):
    pq.write_table(pa.table({"prompt": ["q"], "source": ["crawl"]}), tmp_path / "p.parquet")
    cfg = from_dict(Config, {"input_uri": str(tmp_path), "output_uri": str(tmp_path / "out"), "engine": {"model": "m"}})
    with pytest.raises(ValueError, match=r"p.parquet: has a column `source`.*rename that column"):
        inputs.count_input_rows(cfg, "parquet")


def test_limit_turns_checkpointing_off_and_the_record_must_not_be_the_output(tmp_path):
    base = {"input_uri": "in.jsonl", "output_uri": "out", "engine": {"model": "m"}}
    assert from_dict(Config, base).resumable and not from_dict(Config, {**base, "limit": 5}).resumable
    with pytest.raises(ConfigError, match="checkpoint_uri"):
        from_dict(Config, {**base, "checkpoint_uri": "out/"})
