"""An Iceberg table as the data stage's input, without Ray: the config, the driver's resolution of the table (a real
pyiceberg SQL catalog on SQLite in tmp_path, a table written in two snapshots) and the rows-to-lines mapping.
The stage end to end on Ray is in test_prepare_iceberg.py."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest

from data.config import Config, IcebergCatalog, IcebergTable, content_config_hash, version_config
from data.iceberg_source import (
    block_name,
    catalog_properties,
    parse_filter,
    ray_filter,
    resolve_table,
    to_lines,
)
from data.records import RecordRules, Reject, parse_record
from core.config import ConfigError, from_dict
from tests.data.tables import BAD_ID, FIRST, SCHEMA, catalog_spec, write_table

MAPPING = {"question": "prompt", "answer": "response"}


@pytest.fixture()
def table(tmp_path):
    """(catalog spec, [snapshot 1, snapshot 2]) of a fresh table `chats.qa`."""
    catalog = catalog_spec(str(tmp_path))
    return catalog, write_table(catalog)


def spec(catalog: dict, **fields) -> IcebergTable:
    return from_dict(IcebergTable, {"table": "chats.qa", "catalog": catalog, "key_column": "id", "columns": MAPPING,
                                    **fields}, "test")


def stage_config(**iceberg) -> Config:
    return from_dict(Config, {"inputs": [], "output_uri": "out", "tokenizer": "tok", "format": "instruction",
                              "iceberg": {"table": "chats.qa", "key_column": "id",
                                          "catalog": {"uri": "sqlite:///c.db", "warehouse": "wh"}, **iceberg}}, "test")


def test_a_table_alone_is_an_input_and_counts_as_a_source_not_as_config():
    cfg = stage_config(snapshot_id=5, row_filter="lang = 'en'")
    assert cfg.iceberg.catalog.type == "sql" and cfg.iceberg.snapshot_id == 5
    # What the table gives is hashed with the sources (TableRead.identity), with the snapshot as resolved: a pinned
    # snapshot and `0 = current` resolving to it must make one version, so the table stays out of the config hash.
    assert "iceberg" not in version_config(cfg)
    assert content_config_hash(cfg) == content_config_hash(stage_config())
    assert "iceberg" not in version_config(from_dict(Config, {"inputs": ["a.jsonl"], "output_uri": "o",
                                                              "tokenizer": "t"}, "test"))


@pytest.mark.parametrize("iceberg, field", [
    ({"table": "qa"}, "iceberg.table"),
    ({"catalog": {"uri": "postgresql://user:secret@db/cat", "warehouse": "wh"}}, "iceberg.catalog.uri"),
    ({"key_column": " "}, "iceberg.key_column"),
    ({"snapshot_id": -1}, "iceberg.snapshot_id"),
    ({"columns": {"q": "prompt", "a": "prompt"}}, "iceberg.columns.a"),
])
def test_a_bad_table_config_names_its_field(iceberg, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        stage_config(**iceberg)


def test_a_table_is_not_a_mixture_source():
    with pytest.raises(ConfigError, match="iceberg: a mixture's sources are files"):
        from_dict(Config, {"inputs": [], "output_uri": "o", "tokenizer": "t",
                           "mixture": [{"name": "a", "inputs": ["a.jsonl"], "weight": 1.0}],
                           "iceberg": {"table": "chats.qa", "key_column": "id",
                                       "catalog": {"uri": "sqlite:///c.db", "warehouse": "wh"}}}, "test")


def test_the_snapshot_is_pinned_once_and_identifies_the_rows(table):
    catalog, (first, second) = table
    current = resolve_table(spec(catalog))
    assert current.snapshot_id == second and current.data_files == 2 and current.bytes > 0
    pinned = resolve_table(spec(catalog, snapshot_id=first))
    assert pinned.snapshot_id == first and pinned.data_files == 1
    assert pinned.source == f"iceberg:chats.qa@{first}" and current.source == f"iceberg:chats.qa@{second}"
    # Same snapshot (named or current) -> same identity; another snapshot, filter or mapping -> another.
    assert resolve_table(spec(catalog, snapshot_id=second)).identity() == current.identity()
    assert len({pinned.identity(), current.identity(), resolve_table(spec(catalog, row_filter="id > 3")).identity(),
                resolve_table(spec(catalog, columns={})).identity()}) == 4
    # A filter that rules a whole data file out leaves it unread (pyiceberg prunes by the file's column bounds).
    assert resolve_table(spec(catalog, row_filter="id < 50")).data_files == 1
    entry = current.manifest_entry()
    assert entry["catalog"] == {"name": "tests", "type": "sql", "uri": catalog["uri"], "warehouse": catalog["warehouse"]}
    assert entry["table_uuid"] and entry["location"].endswith("/chats/qa") and entry["key_column"] == "id"


def test_a_catalog_moved_elsewhere_keeps_the_tables_identity(table, tmp_path):
    catalog, _ = table
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(tmp_path / "catalog.db", moved / "catalog.db")
    there = resolve_table(spec({**catalog, "uri": f"sqlite:///{moved}/catalog.db"}))
    here = resolve_table(spec(catalog))
    assert there.catalog != here.catalog and there.identity() == here.identity()


@pytest.mark.parametrize("fields, message", [
    ({"catalog": {"uri": "sqlite:////no/such/catalog.db", "warehouse": "/tmp"}},
     r"iceberg.catalog.uri: no catalog database at /no/such/catalog.db"),
    ({"table": "chats.nope"}, r"iceberg.table: chats.nope is not in the catalog .* \(its tables: chats.qa\)"),
    ({"snapshot_id": 12345}, r"iceberg.snapshot_id: chats.qa has no snapshot 12345 \(its snapshots: \d+, \d+\)"),
    ({"key_column": "uid"}, r"iceberg.key_column: chats.qa has no column 'uid' at snapshot \d+ \(its columns: id, "),
    ({"key_column": "question"}, r"iceberg.key_column: question is string; name an int or long column"),
    ({"columns": {"query": "prompt"}}, r"iceberg.columns.query: chats.qa has no column 'query'"),
    ({"columns": {"question": "lang"}}, r"iceberg.columns: 'lang' is already a column of chats.qa"),
    ({"row_filter": "lang == "}, r"iceberg.row_filter: 'lang == ' is not pyiceberg's filter syntax at character 1"),
    ({"row_filter": "langu = 'en'"}, r"iceberg.row_filter: \"langu = 'en'\": Could not find field with name langu"),
    ({"row_filter": "question like 'What%'"}, r"iceberg.row_filter: StartsWith is not supported here"),
])
def test_a_table_that_does_not_fit_the_config_is_refused_naming_the_field(table, fields, message):
    catalog, _ = table
    with pytest.raises(ValueError, match=message):
        resolve_table(spec(fields.pop("catalog", catalog), **fields))


def test_rows_become_records_of_the_mapped_fields_named_by_their_key(table):
    catalog, (first, _) = table
    read = resolve_table(spec(catalog, snapshot_id=first))
    batch = pa.table(list(zip(*FIRST)), schema=SCHEMA)
    lines = to_lines(batch, read)
    assert lines["line"].to_pylist() == [r[0] for r in FIRST]
    assert set(lines["source"].to_pylist()) == {f"iceberg:chats.qa@{first}"}
    rules = RecordRules(format="instruction")
    parsed = {line: parse_record(raw, kind, rules) for line, raw, kind in
              zip(lines["line"].to_pylist(), lines["raw"].to_pylist(), lines["kind"].to_pylist())}
    assert parsed[1] == [("user", "What is 1 plus 1?"), ("assistant", "It is 2.")]
    assert parsed[BAD_ID] == Reject("empty_text", "response is empty after cleaning")
    assert json.loads(lines["raw"][0].as_py()) == {"id": 1, "prompt": "What is 1 plus 1?", "response": "It is 2.",
                                                   "lang": "en"}
    # A row without a key is still read; its line says it has none.
    nulls = to_lines(pa.table({"id": pa.array([None], pa.int64()), "question": ["q"], "answer": ["a"],
                               "lang": ["en"]}), read)
    assert nulls["line"].to_pylist() == [-1]


def test_shuffle_files_are_named_by_all_of_a_blocks_rows(table):
    catalog, (first, _) = table
    read = resolve_table(spec(catalog, snapshot_id=first))
    batch = pa.table(list(zip(*FIRST)), schema=SCHEMA)
    assert block_name(to_lines(batch, read)) == block_name(to_lines(batch, read))  # a retried task: same files
    # Keys need not be unique: two blocks whose first rows share a key must not write over each other's files.
    assert block_name(to_lines(batch.slice(0, 5), read)) != block_name(to_lines(batch.slice(0, 6), read))


def test_the_row_filter_becomes_a_ray_expression():
    assert ray_filter(parse_filter("")) is None
    expr = ray_filter(parse_filter("lang = 'en' and not id in (1, 2) or answer is null"))
    text = str(expr)
    assert "COL('lang')" in text and "LIT('en')" in text and "IS_NULL" in text and "LIT([1, 2])" in text


def test_catalog_credentials_come_from_the_environment_not_the_config(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8090")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-secret")
    props = catalog_properties(IcebergCatalog(uri="sqlite:///c.db", warehouse="s3://bucket/wh"))
    assert props["s3.endpoint"] == "http://127.0.0.1:8090" and props["s3.force-virtual-addressing"] == "false"
    assert props["s3.region"]
    assert not any(v in ("key-id", "the-secret") for v in props.values())
    assert "s3.endpoint" not in catalog_properties(IcebergCatalog(uri="sqlite:///c.db", warehouse="/tmp/wh"))
