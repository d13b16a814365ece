"""The data stage on a Delta Lake table, end to end on the real local Ray cluster: the table written by `deltalake`
in two versions (tests/data/tables.py), its files on local disk and on the stack's S3.

Each dataset version must hold exactly its table version's rows (decoded back from the shards), a re-run of a
table version must be the same dataset version, a newer table version another one, and a bad row's reject must
name the table, its version and the row's key."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

from core.config import from_dict
from data.config import Config
from tests.data.tables import (BAD_ID, FIRST, check_two_commits, prepare_on_stack, rejects, rendered, segments,
                               write_delta)

MAPPING = {"question": "prompt", "answer": "response"}


def config(uri: str, output_uri: str, tokenizer: str, **delta) -> Config:
    return from_dict(Config, {
        "inputs": [], "output_uri": output_uri, "tokenizer": tokenizer, "format": "instruction", "seq_len": 128,
        "num_shards": 2, "eval_fraction": 0.0, "max_reject_fraction": 0.1,
        "delta": {"uri": uri, "key_column": "id", "columns": MAPPING, **delta},
    }, "tests/data/test_prepare_delta.py")


def test_each_table_version_is_its_own_dataset_version_with_exactly_its_rows(ray_session, local_stack,
                                                                            tiny_model_dir, tok, tmp_path):
    uri = str(tmp_path / "qa")
    first, second = write_delta(uri)
    out, tokenizer = str(tmp_path / "prepared"), str(tiny_model_dir)
    entry = check_two_commits(lambda **f: config(uri, out, tokenizer, row_filter="lang = 'en'", **f),
                              "version", first, second, f"delta:{uri}@{first}", tok)
    assert entry["location"] == uri and entry["kind"] == "delta"


def test_a_table_on_the_stacks_s3(ray_session, s3_bucket, tiny_model_dir, tok):
    root = f"{s3_bucket}/delta-tests/{uuid.uuid4().hex[:8]}"
    first, _ = write_delta(f"{root}/qa")
    result = prepare_on_stack(config(f"{root}/qa", f"{root}/prepared", str(tiny_model_dir), version=first))
    assert result.manifest["delta"]["location"] == f"{root}/qa"
    # The endpoint travels in the manifest (and to the read tasks); the stack's keys never do.
    manifest = json.dumps(result.manifest)
    assert result.manifest["delta"]["catalog"]["AWS_ENDPOINT_URL"] and os.environ["AWS_SECRET_ACCESS_KEY"] not in manifest
    assert os.environ["AWS_ACCESS_KEY_ID"] not in manifest
    assert result.manifest["counts"]["read"] == len(FIRST)
    assert Counter(segments(result.manifest_uri, tok)) == rendered(FIRST, tok)
    assert [r["line"] for r in rejects(result.version_uri)] == [BAD_ID]
