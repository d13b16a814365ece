"""The data stage on an Iceberg table, end to end on the real local Ray cluster: a pyiceberg SQL catalog on SQLite,
the table written in two snapshots (tests/data/tables.py), its files on local disk and on the stack's S3.

Each version must hold exactly its snapshot's rows (decoded back from the shards), a re-run of a snapshot must be
the same version, a newer snapshot another one, and a bad row's reject must name the table, snapshot and key."""

from __future__ import annotations

import uuid
from collections import Counter

from data.config import Config
from core.config import from_dict
from tests.data.tables import (BAD_ID, FIRST, catalog_spec, check_two_commits, prepare_on_stack, rejects, rendered,
                               segments, write_table)

MAPPING = {"question": "prompt", "answer": "response"}


def config(catalog: dict, output_uri: str, tokenizer: str, **iceberg) -> Config:
    return from_dict(Config, {
        "inputs": [], "output_uri": output_uri, "tokenizer": tokenizer, "format": "instruction", "seq_len": 128,
        "num_shards": 2, "eval_fraction": 0.0, "max_reject_fraction": 0.1,
        "iceberg": {"table": "chats.qa", "catalog": catalog, "key_column": "id", "columns": MAPPING, **iceberg},
    }, "tests/data/test_prepare_iceberg.py")


def test_each_snapshot_is_its_own_version_with_exactly_its_rows(ray_session, local_stack, tiny_model_dir, tok,
                                                                tmp_path):
    catalog = catalog_spec(str(tmp_path))
    first, second = write_table(catalog)
    out, tokenizer = str(tmp_path / "prepared"), str(tiny_model_dir)
    entry = check_two_commits(lambda **f: config(catalog, out, tokenizer, row_filter="lang = 'en'", **f),
                              "snapshot_id", first, second, f"iceberg:chats.qa@{first}", tok)
    assert entry["catalog"]["uri"] == catalog["uri"]


def test_a_table_on_the_stacks_s3(ray_session, s3_bucket, tiny_model_dir, tok, tmp_path):
    root = f"{s3_bucket}/iceberg-tests/{uuid.uuid4().hex[:8]}"
    catalog = catalog_spec(str(tmp_path), warehouse=f"{root}/warehouse")
    first, _ = write_table(catalog)
    result = prepare_on_stack(config(catalog, f"{root}/prepared", str(tiny_model_dir), snapshot_id=first))
    assert result.manifest["iceberg"]["location"].startswith(f"{root}/warehouse/")
    assert result.manifest["counts"]["read"] == len(FIRST)
    assert Counter(segments(result.manifest_uri, tok)) == rendered(FIRST, tok)
    assert [r["line"] for r in rejects(result.version_uri)] == [BAD_ID]
