"""Version hashing, count totals, the reject gate and the summary table (pure, no Ray)."""

import re

import pytest

from data.config import Config
from data.manifest import (
    RejectFractionError,
    add_up,
    build_manifest,
    check_reject_fraction,
    dataset_version,
    summary_table,
)
from core.config import from_dict

TOKENIZER = {"name_or_path": "tok", "hash": "ab" * 32, "vocab_size": 512, "eos_token_id": 2, "pad_token_id": 0,
             "chat_template_hash": "cd" * 8}


def shard(b, read=10, rejected=None, dedup=1, train=(2, 5, 100, 40), eval_=(1, 2, 30, 10)):
    split = lambda r, e, t, lt: {"rows": r, "examples": e, "tokens": t, "loss_tokens": lt}  # noqa: E731
    return {"shard": b, "read": read, "rejected_by_reason": rejected or {"invalid_json": 2}, "deduplicated": dedup,
            "truncated": 0, "splits": {"train": split(*train), "eval": split(*eval_)}}


def test_version_is_stable_and_sensitive():
    v = dataset_version({"a": "1" * 64, "b": "2" * 64}, TOKENIZER, "c" * 16)
    # 16 lowercase hex digits: the version names the dataset's directory. Pinned, so the same inputs keep
    # their version across processes and releases (a re-run stays a no-op).
    assert re.fullmatch(r"[0-9a-f]{16}", v) and v == "b779a77c4c6916df"
    assert v == dataset_version({"b": "2" * 64, "a": "1" * 64}, TOKENIZER, "c" * 16)
    # Content-addressed: the same bytes under other file names are the same dataset.
    assert v == dataset_version({"x.jsonl": "2" * 64, "y.jsonl": "1" * 64}, TOKENIZER, "c" * 16)
    assert v != dataset_version({"a": "1" * 64, "b": "3" * 64}, TOKENIZER, "c" * 16)
    assert v != dataset_version({"a": "1" * 64, "b": "2" * 64}, {**TOKENIZER, "hash": "ff" * 32}, "c" * 16)
    assert v != dataset_version({"a": "1" * 64, "b": "2" * 64}, {**TOKENIZER, "chat_template_hash": "0" * 16}, "c" * 16)
    assert v != dataset_version({"a": "1" * 64, "b": "2" * 64}, TOKENIZER, "d" * 16)


def test_add_up_sums_shards_and_refuses_a_shard_built_twice():
    totals = add_up([shard(0), shard(1, rejected={"invalid_json": 1, "too_long": 3})])
    assert totals["counts"] == {"read": 20, "rejected": 6, "rejected_by_reason": {"invalid_json": 3, "too_long": 3},
                                "deduplicated": 2, "near_deduplicated": 0, "truncated": 0, "written_examples": 14}
    assert totals["splits"]["train"] == {"rows": 4, "examples": 10, "tokens": 200, "loss_tokens": 80}
    with pytest.raises(RuntimeError, match=r"shards \[1\]"):
        add_up([shard(1), shard(1)])


def test_reject_gate_names_top_reasons():
    counts = {"read": 100, "rejected": 20, "rejected_by_reason": {"invalid_json": 12, "too_long": 5, "bad_role": 2,
                                                                   "empty_text": 1}}
    with pytest.raises(RejectFractionError) as e:
        check_reject_fraction(counts, 0.1, "s3://b/v/rejects")
    msg = str(e.value)
    assert "20 of 100 records rejected (20.0%" in msg and "invalid_json 12, too_long 5, bad_role 2" in msg
    assert "empty_text" not in msg and "s3://b/v/rejects" in msg
    check_reject_fraction(counts, 0.2, "x")  # at the limit is fine
    with pytest.raises(RejectFractionError, match="no records"):
        check_reject_fraction({"read": 0, "rejected": 0, "rejected_by_reason": {}}, 1.0, "x")


def test_manifest_fields_and_summary(tmp_path):
    cfg = from_dict(Config, {"inputs": ["a.jsonl"], "output_uri": str(tmp_path), "tokenizer": "tok", "seq_len": 64})
    totals = add_up([shard(0)])
    m = build_manifest(cfg, "0123456789abcdef", str(tmp_path / "0123456789abcdef"), ["a.jsonl"], {"a.jsonl": "1" * 64},
                       TOKENIZER, totals, None, num_shards=3)
    assert set(m) == {"version", "created_at", "format", "sources", "source_hashes", "tokenizer", "seq_len", "packing",
                      "num_shards", "splits", "counts", "packing_efficiency", "config", "config_hash", "output_uri", "mlflow_run_id"}
    assert m["splits"]["train"]["path"] == str(tmp_path / "0123456789abcdef" / "train") and m["num_shards"] == 3
    assert m["packing_efficiency"] == round(130 / (3 * 64), 6) and m["config"]["seq_len"] == 64
    table = summary_table(m, str(tmp_path / "0123456789abcdef" / "manifest.json"), wall_s=2.0)
    assert "0123456789abcdef" in table and "invalid_json: 2" in table and "67.7%" in table and "65 tokens/s" in table
