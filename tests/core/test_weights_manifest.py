"""The sha256 manifest of a checkpoint: equal bytes give equal digests, and every change is named by file."""

from __future__ import annotations

import shutil

import pytest

from core import weights_manifest as wm


@pytest.fixture()
def ckpt(tmp_path, tiny_model_dir):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_manifest_lists_every_file_with_its_hash(ckpt):
    import hashlib

    m = wm.build(str(ckpt))
    assert set(m["files"]) == {p.name for p in ckpt.iterdir()}
    weights = (ckpt / "model.safetensors").read_bytes()
    assert m["files"]["model.safetensors"] == {"sha256": hashlib.sha256(weights).hexdigest(), "size": len(weights)}
    assert wm.build(str(ckpt))["digest"] == m["digest"]  # deterministic


def test_a_cache_marker_is_not_part_of_the_checkpoint(ckpt):
    before = wm.build(str(ckpt))["digest"]
    (ckpt / ".complete").write_text("s3://bucket/ckpt")
    assert wm.build(str(ckpt))["digest"] == before


@pytest.mark.parametrize("change, named", [
    ("modify", "model.safetensors: changed since registration"),
    ("remove", "tokenizer.json: missing (registered with the version)"),
    ("add", "extra.safetensors: added after registration"),
])
def test_verify_names_the_file_that_differs(ckpt, change, named):
    registered = wm.build(str(ckpt))
    if change == "modify":
        data = bytearray((ckpt / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF  # one bit of one weight
        (ckpt / "model.safetensors").write_bytes(bytes(data))
    elif change == "remove":
        (ckpt / "tokenizer.json").unlink()
    else:
        (ckpt / "extra.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(wm.ManifestMismatch) as e:
        wm.verify(str(ckpt), registered["digest"], registered, what="rayline-tiny/2")
    assert f"{ckpt}/{named}" in str(e.value) and "rayline-tiny/2" in str(e.value)


def test_verify_passes_the_same_bytes_anywhere(ckpt, tmp_path):
    registered = wm.build(str(ckpt))
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert wm.verify(str(copy), registered["digest"])["digest"] == registered["digest"]


def test_an_empty_checkpoint_has_no_manifest(tmp_path):
    with pytest.raises(wm.ManifestMismatch, match="no files to hash"):
        wm.build(str(tmp_path))
