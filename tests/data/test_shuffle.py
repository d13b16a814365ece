"""The shuffle through storage (data/shuffle.py): each read task's rows land in one file per shard, a shard reads back
exactly its rows, and a retried task rewrites its files instead of adding copies."""

from __future__ import annotations

import pyarrow as pa

from data.shuffle import read_partition, shuffle_uri, write_partitions
from core import storage


def block(source: str, lines: range, parts: list[int]) -> pa.Table:
    return pa.table({"part": pa.array(parts, pa.int32()), "source": [source] * len(lines), "line": list(lines),
                     "text": [f"{source}:{n}" for n in lines]})


def test_each_shard_gets_its_rows_in_one_file_per_task(tmp_path):
    version = str(tmp_path / "v1")
    task_a = [block("a.jsonl", range(1, 6), [2, 0, 2, 1, 0]), block("a.jsonl", range(6, 9), [0, 0, 0])]
    task_b = [block("b.jsonl", range(1, 4), [1, 1, 1])]
    a, b = (write_partitions(iter(task), version).to_pylist() for task in (task_a, task_b))
    assert [(r["part"], r["rows"]) for r in a] == [(0, 5), (1, 1), (2, 2)] and [(r["part"], r["rows"]) for r in b] == [(1, 3)]
    assert len({r["uri"] for r in a + b}) == 4 and all(r["uri"].startswith(shuffle_uri(version) + "/part-0000") for r in a + b)

    def shard(part):
        return read_partition(sorted(r["uri"] for r in a + b if r["part"] == part))["text"].to_pylist()

    # Every row in the shard its `part` names, once, in the order the task read it.
    assert sorted(shard(0)) == sorted(["a.jsonl:2", "a.jsonl:5", "a.jsonl:6", "a.jsonl:7", "a.jsonl:8"])
    assert [t for t in shard(0) if t.startswith("a")] == ["a.jsonl:2", "a.jsonl:5", "a.jsonl:6", "a.jsonl:7", "a.jsonl:8"]
    assert sorted(shard(1)) == ["a.jsonl:4", "b.jsonl:1", "b.jsonl:2", "b.jsonl:3"] and shard(2) == ["a.jsonl:1", "a.jsonl:3"]

    # A retried task (same input) writes the same files again: the shard holds its rows once.
    again = write_partitions(iter(task_a), version).to_pylist()
    assert again == a and len(storage.list_files(shuffle_uri(version))) == 4
    assert sorted(shard(0)) == sorted(["a.jsonl:2", "a.jsonl:5", "a.jsonl:6", "a.jsonl:7", "a.jsonl:8"])


def test_a_task_with_no_rows_writes_nothing(tmp_path):
    empty = block("a.jsonl", range(1, 1), [])
    assert write_partitions(iter([empty]), str(tmp_path / "v1")).num_rows == 0
    assert not storage.exists(shuffle_uri(str(tmp_path / "v1")))
