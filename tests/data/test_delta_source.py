"""A Delta Lake table as the data stage's input, without Ray: the config, and the driver's resolution of a real table
(written by `deltalake` in tmp_path in two versions, tests/data/tables.py). The stage end to end on Ray is in
test_prepare_delta.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

from core.config import ConfigError, from_dict
from data.config import Config, DeltaSource, content_config_hash, version_config
from data.delta_source import resolve_delta, storage_options
from data.iceberg_source import to_lines
from tests.data.tables import FIRST, write_delta

MAPPING = {"question": "prompt", "answer": "response"}


def spec(uri: str, **fields) -> DeltaSource:
    return from_dict(DeltaSource, {"uri": uri, "key_column": "id", "columns": MAPPING, **fields}, "test")


def stage_config(**delta) -> Config:
    return from_dict(Config, {"inputs": [], "output_uri": "out", "tokenizer": "tok", "format": "instruction",
                              "delta": {"uri": "tables/qa", "key_column": "id", **delta}}, "test")


def test_a_table_alone_is_an_input_and_counts_as_a_source_not_as_config():
    cfg = stage_config(version=3, row_filter="lang = 'en'")
    assert cfg.delta.version == 3 and cfg.delta.uri == "tables/qa"
    # The version as resolved is hashed with the sources (TableRead.identity): `-1 = current` resolving to 3 and 3
    # named outright must make one dataset version, so the table stays out of the config hash.
    assert "delta" not in version_config(cfg)
    assert content_config_hash(cfg) == content_config_hash(stage_config())


@pytest.mark.parametrize("delta, field", [
    ({"uri": " "}, "delta.uri"),
    ({"key_column": ""}, "delta.key_column"),
    ({"version": -2}, "delta.version"),
    ({"columns": {"question": "prompt", "answer": "prompt"}}, "delta.columns.answer"),
])
def test_a_bad_table_config_names_its_field(delta, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        stage_config(**delta)


def test_one_table_per_dataset_and_no_table_in_a_mixture():
    with pytest.raises(ConfigError, match="one table per dataset"):
        from_dict(Config, {"inputs": [], "output_uri": "o", "tokenizer": "t",
                           "delta": {"uri": "a", "key_column": "id"},
                           "iceberg": {"table": "n.t", "key_column": "id",
                                       "catalog": {"uri": "sqlite:///c.db", "warehouse": "wh"}}}, "test")
    with pytest.raises(ConfigError, match="delta: a mixture's sources are files"):
        from_dict(Config, {"inputs": [], "output_uri": "o", "tokenizer": "t", "delta": {"uri": "a", "key_column": "id"},
                           "mixture": [{"name": "a", "inputs": ["x.jsonl"], "weight": 1}]}, "test")


def test_the_current_version_is_pinned_once_and_a_named_one_is_kept(tmp_path):
    uri = str(tmp_path / "qa")
    first, second = write_delta(uri)
    current = resolve_delta(spec(uri))
    assert (current.snapshot_id, current.kind, current.source) == (second, "delta", f"delta:{uri}@{second}")
    assert current.data_files == 2 and current.bytes > 0  # one file per commit
    old = resolve_delta(spec(uri, version=first))
    assert old.snapshot_id == first and old.data_files == 1
    # The same rows named two ways are one identity; another version is another.
    assert resolve_delta(spec(uri, version=second)).identity() == current.identity() != old.identity()
    assert current.table_uuid == old.table_uuid  # the table's own id, from its log
    assert current.manifest_entry()["kind"] == "delta" and current.catalog == {}  # local: no storage options


def test_a_table_that_does_not_fit_the_config_is_refused_naming_the_field(tmp_path):
    uri = str(tmp_path / "qa")
    write_delta(uri)
    with pytest.raises(ValueError, match=r"delta.uri: no Delta table at .*missing"):
        resolve_delta(spec(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"delta.version: .* has no version 9 \(its versions: 0 .. 1\)"):
        resolve_delta(spec(uri, version=9))
    with pytest.raises(ValueError, match=r"delta.columns.query: .* has no column 'query' at version 1 \(its columns: "
                                         r"id, question, answer, lang\)"):
        resolve_delta(spec(uri, columns={"query": "prompt"}))
    with pytest.raises(ValueError, match="delta.key_column: lang is string; name an integer column"):
        resolve_delta(spec(uri, key_column="lang"))
    with pytest.raises(ValueError, match="delta.columns: 'lang' is already a column"):
        resolve_delta(spec(uri, columns={"question": "lang"}))
    with pytest.raises(ValueError, match=r"delta.row_filter: 'lang ==' is not pyiceberg's filter syntax"):
        resolve_delta(spec(uri, row_filter="lang =="))


def test_rows_become_raw_lines_named_by_the_table_version_and_key(tmp_path):
    uri = str(tmp_path / "qa")
    write_delta(uri)
    read = resolve_delta(spec(uri))
    batch = pa.table({"id": [1, None], "question": [FIRST[0][1], "q"], "answer": [FIRST[0][2], "a"],
                      "lang": ["en", "en"]})
    lines = to_lines(batch, read).to_pylist()
    assert [(r["source"], r["line"], r["kind"]) for r in lines] == [(read.source, 1, "delta"), (read.source, -1, "delta")]
    assert b'"prompt": "What is 1 plus 1?"' in lines[0]["raw"] and b'"response": "It is 2."' in lines[0]["raw"]


def test_s3_options_carry_the_endpoint_and_never_a_key(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-secret")
    options = storage_options("s3://bucket/tables/qa")
    assert options["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000" and options["AWS_ALLOW_HTTP"] == "true"
    assert not any("a-key-id" in v or "a-secret" in v for v in options.values())
    assert storage_options("/local/qa") == {}
