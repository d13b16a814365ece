"""The data stage on an Iceberg table, end to end on the real local Ray cluster: a pyiceberg SQL catalog on SQLite,
the table written in two snapshots (tests/data/iceberg_tables.py), its files on local disk and on the stack's S3.

Each version must hold exactly its snapshot's rows (decoded back from the shards), a re-run of a snapshot must be
the same version, a newer snapshot another one, and a bad row's reject must name the table, snapshot and key."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import pytest

from data.config import Config
from data.prepared import read_split
from data.tokens import load_tokenizer, read_tokenizer_files
from core import storage
from core.config import from_dict
from tests.data.iceberg_tables import BAD_ID, FIRST, SECOND, catalog_spec, rows, write_table

MAPPING = {"question": "prompt", "answer": "response"}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(read_tokenizer_files(str(tiny_model_dir))[1])


def main(cfg):
    from data.prepare import main as prepare  # after the stack's variables are set (see test_prepare.py)

    return prepare(cfg)


def config(catalog: dict, output_uri: str, tokenizer: str, **iceberg) -> Config:
    return from_dict(Config, {
        "inputs": [], "output_uri": output_uri, "tokenizer": tokenizer, "format": "instruction", "seq_len": 128,
        "num_shards": 2, "eval_fraction": 0.0, "max_reject_fraction": 0.1,
        "iceberg": {"table": "chats.qa", "catalog": catalog, "key_column": "id", "columns": MAPPING, **iceberg},
    }, "tests/data/test_prepare_iceberg.py")


def segments(manifest_uri: str, tok) -> list[str]:
    """Every packed example of the train split, decoded."""
    out = []
    for batch in read_split(manifest_uri, "train").iter_batches(batch_size=256, batch_format="numpy"):
        for ids, seg in zip(batch["input_ids"], batch["segment_ids"]):
            out += [tok.decode(ids[seg == s]) for s in range(1, seg.max() + 1)]
    return out


def rendered(table_rows: list[tuple], tok) -> Counter:
    """The chat-template text of every valid row (the empty answer is not one)."""
    return Counter(tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                           tokenize=False) for _, q, a, _ in table_rows if a)


def rejects(version_uri: str) -> list[dict]:
    folder = storage.join(version_uri, "rejects")
    return [json.loads(line) for f in storage.list_files(folder)
            for line in storage.read_text(storage.join(folder, f)).splitlines()]


def test_each_snapshot_is_its_own_version_with_exactly_its_rows(ray_session, local_stack, tiny_model_dir, tok,
                                                                tmp_path):
    catalog = catalog_spec(str(tmp_path))
    first, second = write_table(catalog)
    out, tokenizer = str(tmp_path / "prepared"), str(tiny_model_dir)

    # Version A: pinned to snapshot 1, English rows only, question/answer mapped to prompt/response.
    cfg_a = config(catalog, out, tokenizer, snapshot_id=first, row_filter="lang = 'en'")
    a = main(cfg_a)
    m = a.manifest
    assert m["sources"] == [f"iceberg:chats.qa@{first}"]
    assert m["iceberg"]["snapshot_id"] == first and m["iceberg"]["row_filter"] == "lang = 'en'"
    assert m["iceberg"]["columns"] == MAPPING and m["iceberg"]["catalog"]["uri"] == catalog["uri"]
    english = rows(FIRST, lang="en")
    assert m["counts"]["read"] == len(english) and m["counts"]["rejected_by_reason"] == {"empty_text": 1}
    assert Counter(segments(a.manifest_uri, tok)) == rendered(english, tok)

    # The bad row's reject names the table, the snapshot and the row's key, and keeps the row as read (mapped).
    (bad,) = rejects(a.version_uri)
    assert (bad["source"], bad["line"], bad["reason"]) == (f"iceberg:chats.qa@{first}", BAD_ID, "empty_text")
    assert json.loads(bad["raw"])["prompt"] == FIRST[BAD_ID - 1][1] and json.loads(bad["raw"])["response"] == ""

    # Version B: the current snapshot (2) -> another version, holding both appends' English rows.
    cfg_b = config(catalog, out, tokenizer, row_filter="lang = 'en'")
    b = main(cfg_b)
    assert b.version != a.version and b.manifest["iceberg"]["snapshot_id"] == second
    assert b.manifest["counts"]["read"] == len(rows(FIRST, SECOND, lang="en"))
    assert Counter(segments(b.manifest_uri, tok)) == rendered(rows(FIRST, SECOND, lang="en"), tok)

    # Re-runs: A again is A, untouched; snapshot 2 named outright is B.
    again = main(cfg_a)
    assert again.skipped and again.version == a.version and again.manifest == a.manifest
    named = main(config(catalog, out, tokenizer, snapshot_id=second, row_filter="lang = 'en'"))
    assert named.skipped and named.version == b.version


def test_a_table_on_the_stacks_s3(ray_session, s3_bucket, tiny_model_dir, tok, tmp_path):
    root = f"{s3_bucket}/iceberg-tests/{uuid.uuid4().hex[:8]}"
    catalog = catalog_spec(str(tmp_path), warehouse=f"{root}/warehouse")
    first, _ = write_table(catalog)
    result = main(config(catalog, f"{root}/prepared", str(tiny_model_dir), snapshot_id=first))
    assert result.manifest["iceberg"]["location"].startswith(f"{root}/warehouse/")
    assert result.manifest["counts"]["read"] == len(FIRST)
    assert Counter(segments(result.manifest_uri, tok)) == rendered(FIRST, tok)
    assert [r["line"] for r in rejects(result.version_uri)] == [BAD_ID]
