"""Finding input files and reading them as raw lines with their line numbers (no Ray needed)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.sources
from data.sources import SourceFile, discover, group_files, hash_file, read_lines, scan_file, split_file


def rows(f, block_rows=1000):
    return [r for block in read_lines(f, block_rows) for r in block.to_pylist()]


def test_jsonl_lines_keep_numbers_and_bytes(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"a": 1}\r\n\n   \n{"b": "caf\xe9"}\n{"c": 3}')  # CRLF, blank lines, bad UTF-8, no final newline
    got = rows(SourceFile(str(p), "jsonl", 0, p.stat().st_size))
    assert [(r["line"], r["raw"]) for r in got] == [(1, b'{"a": 1}'), (4, b'{"b": "caf\xe9"}'), (5, b'{"c": 3}')]
    assert {r["source"] for r in got} == {str(p)} and {r["kind"] for r in got} == {"jsonl"}


def test_byte_order_mark_opens_the_file_not_its_first_record(tmp_path):
    p = tmp_path / "windows.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\xef\xbb\xbf{"b": 2}\r\n')  # as Notepad saves UTF-8; a BOM mid-file is data
    got = rows(SourceFile(str(p), "jsonl", 0, p.stat().st_size))
    assert [(r["line"], r["raw"]) for r in got] == [(1, b'{"a": 1}'), (2, b'\xef\xbb\xbf{"b": 2}')]
    later_part = [r["raw"] for r in rows(split_file(SourceFile(str(p), "jsonl", 0, p.stat().st_size), [(13, 2)])[1])]
    assert later_part == [b'\xef\xbb\xbf{"b": 2}']  # only the part at byte 0 starts the file


def test_blocks_are_bounded(tmp_path):
    p = tmp_path / "many.txt"
    p.write_text("".join(f"line {i}\n" for i in range(2500)))
    blocks = list(read_lines(SourceFile(str(p), "text", 1, p.stat().st_size), 1000))
    assert sum(b.num_rows for b in blocks) == 2500
    assert blocks[-1].to_pylist()[-1] == {"source": str(p), "line": 2500, "raw": b"line 2499", "kind": "text", "split": 1}


def test_parquet_rows_become_json_with_row_index(tmp_path):
    p = tmp_path / "chat.parquet"
    messages = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 3
    pq.write_table(pa.table({"messages": messages, "id": [10, 11, 12]}), p)
    got = rows(SourceFile(str(p), "parquet", 0, p.stat().st_size), block_rows=2)
    assert [r["line"] for r in got] == [0, 1, 2]
    assert json.loads(got[2]["raw"]) == {"messages": messages[2], "id": 12}


def test_discover_walks_directories_and_refuses_unknown_files(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.jsonl").write_text("{}\n")
    (tmp_path / "d" / "sub" / "a.parquet").write_bytes(b"x")
    (tmp_path / "d" / "_SUCCESS").write_text("")
    files = discover([str(tmp_path / "d")], "auto", 0, "inputs")
    assert [(f.uri.rsplit("/", 1)[1], f.kind) for f in files] == [("b.jsonl", "jsonl"), ("a.parquet", "parquet")]
    (tmp_path / "d" / "notes.csv").write_text("x")
    with pytest.raises(ValueError, match=r"inputs\[0\]: .*notes.csv has extension '.csv'"):
        discover([str(tmp_path / "d")], "auto", 0, "inputs")
    assert [f.kind for f in discover([str(tmp_path / "d" / "notes.csv")], "text", 1, "eval_inputs")] == ["text"]
    with pytest.raises(FileNotFoundError, match=r"eval_inputs\[0\]: .*missing does not exist"):
        discover([str(tmp_path / "missing")], "auto", 1, "eval_inputs")


def test_hash_and_read_task_groups(tmp_path):
    files = []
    for i in range(7):
        p = tmp_path / f"{i}.jsonl"
        p.write_text("{}\n" * (i + 1))
        files.append(SourceFile(str(p), "jsonl", 0, p.stat().st_size))
    assert hash_file(files[0].uri) != hash_file(files[1].uri)
    groups = group_files(files, 2)
    assert len(groups) == 2  # seven small files grouped into two read tasks, balanced by size
    assert sorted(f.uri for g in groups for f in g) == sorted(f.uri for f in files)
    assert abs(sum(f.size for f in groups[0]) - sum(f.size for f in groups[1])) <= files[0].size
    assert group_files(files[:3], 2) == [[f] for f in files[:3]]


@pytest.mark.parametrize("chunk_bytes", [7, 64, 8 << 20])
@pytest.mark.parametrize("part_bytes", [1, 5, 13, 40, 1000])
def test_parts_of_a_file_read_exactly_its_lines(tmp_path, monkeypatch, chunk_bytes, part_bytes):
    monkeypatch.setattr(data.sources, "_CHUNK_BYTES", chunk_bytes)
    p = tmp_path / "big.jsonl"
    lines = [b'{"i": %d, "pad": "%s"}' % (i, b"x" * (i * 7 % 23)) for i in range(40)]
    lines[5], lines[9] = b"", b"   "  # blank lines are separators, not records, but still count
    lines[12] += b"\r"
    p.write_bytes(b"\n".join(lines))  # no final newline
    f = SourceFile(str(p), "jsonl", 0, p.stat().st_size)
    digest, cuts = scan_file(f.uri, part_bytes)
    assert digest == hash_file(f.uri)
    parts = split_file(f, cuts)
    assert len(parts) > 1 or part_bytes == 1000
    assert sum(part.size for part in parts) == f.size
    assert all(part.size > 0 for part in parts)
    whole = rows(f)
    assert [r for part in parts for r in rows(part, block_rows=3)] == whole
    assert [r["line"] for r in whole] == [i + 1 for i in range(40) if i not in (5, 9)]
