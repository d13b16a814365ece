"""One shard end to end without Ray: records -> examples -> dedup, tokenize, pack, Parquet and rejects."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.examples import EVAL, TRAIN, ExamplePlan, to_examples
from data.records import RecordRules
from data.shards import ShardPlan, build_shard
from data.sources import LINES_SCHEMA
from data.template import ChatRenderer, TemplateSpec
from data.tokens import IGNORE, load_backend, load_tokenizer, read_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    _, files = read_tokenizer_files(str(tiny_model_dir))
    return files, load_tokenizer(files)


def chat(q, a, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return json.dumps({"messages": msgs}).encode()


def lines_block(records):
    """records: (source, line, raw bytes, kind, split)."""
    cols = list(zip(*records))
    return pa.table(dict(zip(LINES_SCHEMA.names, cols)), schema=LINES_SCHEMA)


def run_shard(tmp_path, tokenizer, records, fmt="chat", seq_len=64, packing="pack", truncate=False, eval_fraction=0.0):
    files, tok = tokenizer
    spec = TemplateSpec(tok.chat_template, dict(tok.special_tokens_map), tok.eos_token)
    plan = ExamplePlan(RecordRules(format=fmt), ChatRenderer.build(spec), seed=3, eval_fraction=eval_fraction, seq_len=seq_len)
    group = to_examples(lines_block(records), plan)
    shard = ShardPlan(str(tmp_path / "v1"), tok.backend_tokenizer.to_str(), fmt, seq_len, packing, truncate, True, 3,
                      tok.pad_token_id, tokenize_batch_size=4)
    return build_shard(group, load_backend(shard.backend_json), shard), tok


def only_file(folder):
    """The one file a single-shard run writes in `folder` (named by the shard's smallest key)."""
    (path,) = folder.iterdir()
    assert path.name.startswith("part-") and len(path.stem) == len("part-") + 16
    return path


def read_rows(folder):
    return pq.read_table(only_file(folder)).to_pylist()


def documents(rows, tok):
    """Decode every packed segment back to text, with the text of its label tokens."""
    out = []
    for r in rows:
        seg = np.array(r["segment_ids"])
        ids, labels = np.array(r["input_ids"]), np.array(r["labels"])
        for s in range(1, seg.max() + 1):
            where = seg == s
            out.append((tok.decode(ids[where]), tok.decode(ids[where & (labels != IGNORE)])))
    return out


def test_dedup_across_sources_and_normalisation(tmp_path, tokenizer):
    records = [
        ("a.jsonl", 1, chat("What is 1 + 1?", "2"), "jsonl", TRAIN),
        ("b.jsonl", 7, chat("What is 1 + 1? ", "2"), "jsonl", TRAIN),            # same after cleaning
        ("b.jsonl", 8, chat("Cafe\u0301?", "yes"), "jsonl", TRAIN),
        ("c.jsonl", 2, chat("Caf\u00e9?", "yes"), "jsonl", EVAL),                # NFC twin; the eval copy wins
        ("a.jsonl", 2, chat("What is 2 + 2?", "4", system="Terse."), "jsonl", TRAIN),
    ]
    stats, tok = run_shard(tmp_path, tokenizer, records)
    assert stats["read"] == 5 and stats["deduplicated"] == 2 and stats["rejected_by_reason"] == {}
    assert stats["splits"]["train"]["examples"] == 2 and stats["splits"]["eval"]["examples"] == 1
    train = documents(read_rows(tmp_path / "v1" / "train"), tok)
    eval_ = documents(read_rows(tmp_path / "v1" / "eval"), tok)
    assert sorted(label for _, label in train) == ["2<|im_end|>", "4<|im_end|>"]
    assert [text for text, _ in eval_] == ["<|im_start|>user\nCafé?<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"]
    assert any("<|im_start|>system\nTerse.<|im_end|>" in text for text, _ in train)


def test_rows_have_the_contract_columns(tmp_path, tokenizer):
    records = [("a.jsonl", i + 1, chat(f"Repeat exactly: word {i}", f"word {i}"), "jsonl", TRAIN) for i in range(30)]
    stats, _ = run_shard(tmp_path, tokenizer, records, seq_len=64)
    table = pq.read_table(only_file(tmp_path / "v1" / "train"))
    assert table.schema.names == ["input_ids", "labels", "position_ids", "segment_ids"]
    assert all(pa.types.is_list(t) and t.value_type == pa.int32() for t in table.schema.types)
    assert {len(x) for x in table["input_ids"].to_pylist()} == {64}
    s = stats["splits"]["train"]
    assert s["rows"] == table.num_rows and s["examples"] == 30 and s["tokens"] < s["rows"] * 64
    assert s["loss_tokens"] == sum(sum(v != IGNORE for v in r) for r in table["labels"].to_pylist())


def test_over_length_is_rejected_with_its_raw_record(tmp_path, tokenizer):
    long = chat("Repeat exactly: " + "kiwi " * 40, "kiwi " * 40)
    records = [("a.jsonl", 3, long, "jsonl", TRAIN), ("a.jsonl", 4, chat("What is 3 + 4?", "7"), "jsonl", TRAIN),
               ("a.jsonl", 5, b"{broken", "jsonl", TRAIN)]
    stats, _ = run_shard(tmp_path, tokenizer, records, seq_len=32)
    assert stats["rejected_by_reason"] == {"too_long": 1, "invalid_json": 1}
    rejects = [json.loads(x) for x in only_file(tmp_path / "v1" / "rejects").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(3, "too_long"), (5, "invalid_json")]
    assert rejects[0]["raw"] == long.decode() and rejects[1]["raw"] == "{broken" and rejects[0]["source"] == "a.jsonl"
    assert stats["splits"]["train"]["examples"] == 1


def test_truncate_cuts_and_counts(tmp_path, tokenizer):
    records = [("a.jsonl", 1, chat("hi", "kiwi " * 40), "jsonl", TRAIN),     # answer cut: kept, truncated
               ("a.jsonl", 2, chat("kiwi " * 40, "ok"), "jsonl", TRAIN)]     # answer cut away entirely: rejected
    stats, tok = run_shard(tmp_path, tokenizer, records, seq_len=32, truncate=True)
    assert stats["truncated"] == 1 and stats["rejected_by_reason"] == {"too_long": 1}
    rows = read_rows(tmp_path / "v1" / "train")
    assert len(rows) == 1 and all(s == 1 for s in rows[0]["segment_ids"])
    assert tok.decode(rows[0]["input_ids"]).startswith("<|im_start|>user\nhi<|im_end|>")


def test_text_format_splits_long_documents_without_loss(tmp_path, tokenizer):
    words = " ".join(f"{i}" for i in range(100))
    records = [("t.txt", 1, words.encode(), "text", TRAIN), ("t.txt", 2, b"short doc", "text", TRAIN)]
    stats, tok = run_shard(tmp_path, tokenizer, records, fmt="text", seq_len=32, packing="pad")
    rows = read_rows(tmp_path / "v1" / "train")
    assert stats["truncated"] == 0 and stats["splits"]["train"]["examples"] == 2
    assert stats["splits"]["train"]["tokens"] == stats["splits"]["train"]["loss_tokens"]  # every real token is a label
    pieces = [[i for i, s in zip(r["input_ids"], r["segment_ids"]) if s] for r in rows]
    short = tok(b"short doc".decode() + tok.eos_token, add_special_tokens=False)["input_ids"]
    long = tok(words + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert pieces.count(short) == 1
    # The long document comes back as seq_len-aligned pieces (rows are shuffled, so match by offset).
    offsets = sorted(next(k for k in range(0, len(long), 32) if long[k:k + len(p)] == p) for p in pieces if p != short)
    assert offsets == list(range(0, len(long), 32))


def test_same_shard_twice_writes_the_same_files(tmp_path, tokenizer):
    records = [("a.jsonl", i + 1, chat(f"What is {i} + 1?", str(i + 1)), "jsonl", TRAIN) for i in range(40)]
    run_shard(tmp_path / "x", tokenizer, list(reversed(records)), eval_fraction=0.2)
    run_shard(tmp_path / "y", tokenizer, records, eval_fraction=0.2)
    for split in ("train", "eval"):
        a, b = only_file(tmp_path / "x" / "v1" / split), only_file(tmp_path / "y" / "v1" / split)
        assert a.name == b.name and pq.read_table(a).equals(pq.read_table(b))  # input order does not matter: the seeded order does
