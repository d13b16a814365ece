"""Compressed JSONL and text inputs, and many small files: read as streams, the same records as the plain files
(no Ray needed; the stage end to end on them is in test_prepare.py)."""

import gzip
import os

import pyarrow as pa
import pytest

import data.sources
from data.datasource import coalesce
from data.sources import FilePart, SourceFile, discover, group_files, read_lines, scan_file, split_file

LINES = b'\xef\xbb\xbf{"a": 1}\r\n\n   \n{"b": "caf\xe9"}\n' + b"".join(b'{"i": %d}\n' % i for i in range(300)) + b'{"z": 0}'


def compress(path, data: bytes, codec: str):
    """Write `data` to `path` compressed with `codec` (gzip through Python's gzip, zstd through pyarrow's codec)."""
    if codec == "gzip":
        path.write_bytes(gzip.compress(data))
    else:
        with pa.output_stream(str(path), compression=codec) as out:
            out.write(data)


def rows(f, block_rows=1000):
    return [(r["line"], r["raw"], r["kind"]) for block in read_lines(f, block_rows) for r in block.to_pylist()]


@pytest.mark.parametrize("name, codec, kind", [("a.jsonl.gz", "gzip", "jsonl"), ("a.jsonl.zst", "zstd", "jsonl"),
                                               ("a.txt.gz", "gzip", "text"), ("a.txt.zst", "zstd", "text")])
def test_compressed_files_read_as_the_plain_file(tmp_path, monkeypatch, name, codec, kind):
    monkeypatch.setattr(data.sources, "_CHUNK_BYTES", 100)  # lines cross the decompressed chunks
    plain = tmp_path / ("plain.jsonl" if kind == "jsonl" else "plain.txt")
    plain.write_bytes(LINES)
    packed = tmp_path / name
    compress(packed, LINES, codec)
    (found,) = discover([str(packed)], "auto", 0, "inputs")
    assert (found.kind, found.compression, found.size) == (kind, codec, packed.stat().st_size)
    assert not found.splittable
    (plain_file,) = discover([str(plain)], "auto", 0, "inputs")
    before = sorted(os.listdir(tmp_path))
    got = rows(found, block_rows=7)
    # The same lines, numbers (blank lines counted, the BOM dropped, CRLF cut) and bytes as the plain file.
    assert got == rows(plain_file) and got[:2] == [(1, b'{"a": 1}', kind), (4, b'{"b": "caf\xe9"}', kind)]
    assert got[-1][0] == LINES.count(b"\n") + 1
    assert sorted(os.listdir(tmp_path)) == before  # streamed: nothing decompressed to disk
    # A compressed file is one part: it cannot be entered in the middle.
    digest, _ = scan_file(found.uri, 0)
    assert split_file(found, [(50, 4)]) == [FilePart(found)] and len(digest) == 64


def test_compression_errors_name_the_file(tmp_path):
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(gzip.compress(LINES)[:-30])  # truncated in transfer
    (f,) = discover([str(bad)], "auto", 0, "inputs")
    with pytest.raises(ValueError, match=r"cut.jsonl.gz: cannot read it as gzip"):
        rows(f)
    (tmp_path / "t.parquet.gz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"inputs\[0\]: .*t.parquet.gz is a compressed Parquet file"):
        discover([str(tmp_path / "t.parquet.gz")], "auto", 0, "inputs")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.csv.zst").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"inputs\[1\]: .*x.csv.zst has extension '.csv'.*\.gz, \.zst"):
        discover([str(tmp_path / "cut.jsonl.gz"), str(tmp_path / "d")], "auto", 0, "inputs")


def test_many_small_files_are_few_tasks_and_few_blocks(tmp_path):
    """3,000 files of a few records: grouped into `parallelism` read tasks, each task's lines coalesced into blocks of
    `block_rows`, with every record's file and line kept."""
    files = []
    for i in range(3000):
        p = tmp_path / f"{i:05d}.jsonl"
        p.write_bytes(b"".join(b'{"f": %d, "r": %d}\n' % (i, r) for r in range(i % 3 + 1)))
        files.append(FilePart(SourceFile(str(p), "jsonl", 0, p.stat().st_size)))
    groups = group_files(files, 8)
    assert len(groups) == 8
    blocks = [list(coalesce((b for f in g for b in read_lines(f, 1000)), 1000)) for g in groups]
    assert all(len(task) <= 2 for task in blocks)  # ~750 records a task: one or two blocks, not ~375
    got = sorted((r["source"], r["line"], r["raw"]) for task in blocks for b in task for r in b.to_pylist())
    want = sorted((f.file.uri, r + 1, b'{"f": %d, "r": %d}' % (i, r)) for i, f in enumerate(files) for r in range(i % 3 + 1))
    assert got == want
