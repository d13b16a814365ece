"""The hand-off API's manifest loading (reading shards is covered end to end in test_prepare.py)."""

import json

import pytest

from data.prepared import COLUMNS, load_manifest


def test_columns_constant():
    assert COLUMNS == ("input_ids", "labels", "position_ids", "segment_ids")


def test_load_manifest_from_file_or_directory(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps({"version": "v1"}))
    assert load_manifest(str(tmp_path / "v1")) == {"version": "v1"}
    assert load_manifest(str(tmp_path / "v1") + "/") == {"version": "v1"}
    assert load_manifest(str(tmp_path / "v1" / "manifest.json")) == {"version": "v1"}


def test_missing_or_broken_manifest_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"v2/manifest.json: no manifest"):
        load_manifest(str(tmp_path / "v2"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not a valid manifest"):
        load_manifest(str(tmp_path / "bad.json"))
